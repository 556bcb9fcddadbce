"""A model whose tables a checkpoint restores is not drawn first (`restoring_tables`), and on the
CPU a loaded run's tensors are the checkpoint file's own: the same scores, the same refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from flowrec.planner.contract import scoring_plan
from flowrec.runtime.checkpoint.store import CheckpointError, load_checkpoint
from flowrec.runtime.lowering import lower
from flowrec.serving.trained import _spec_of, load_trained, stored_plan
from operators import embedding

SPEC = """
name: tiny
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user_id, type: categorical, hash_buckets: 300, dim: 8}
  - {name: item_id, type: categorical, hash_buckets: 700, dim: 4}
  - {name: tags, type: categorical, hash_buckets: 90, dim: 4, max_len: 3, pooling: mean}
modules:
  - {name: deep, kind: mlp, inputs: ["@dense", user_id, item_id, tags], layers: [16]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adagrad, lr: 0.1}
training:
  batch_size: 128
  epochs: 1
  eval_every: 0
"""


def _group() -> PackedGroup:
    return PackedGroup("g", 4, "fp32", ("sgd", 0.1, ()), (TableSlot("a", 40, 0), TableSlot("b", 9, 40)),
                       (GroupField("fa", "a", 1, "sum"), GroupField("fb", "b", 2, "mean")))


def _draws(monkeypatch: pytest.MonkeyPatch, module=embedding) -> list[str]:
    """The tables `module` draws from now on (by `init_table_rows`), in order."""
    drawn: list[str] = []
    plain = module.init_table_rows
    monkeypatch.setattr(module, "init_table_rows", lambda table, *a, **k: (drawn.append(table), plain(table, *a, **k))[1])
    return drawn


def test_tables_restored_next_are_allocated_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = _draws(monkeypatch)
    with embedding.restoring_tables():
        assert embedding.restoring()
        emb = embedding.PackedEmbeddingBag(_group(), seed=3)
    assert drawn == [] and emb.weight.shape == (49, 4)
    with pytest.raises(ValueError, match="inside"):  # the context ends with an error as well
        with embedding.restoring_tables():
            raise ValueError("inside")
    assert not embedding.restoring()
    again = embedding.PackedEmbeddingBag(_group(), seed=3)
    assert sorted(drawn) == ["a", "b"]
    assert torch.equal(again.table_rows("a"), embedding.init_table_rows("a", 40, 4, seed=3))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("restored")
    spec = root / "tiny.yaml"
    spec.write_text(SPEC)
    flowrec.train(spec, out=root / "run", rows=1500, max_steps=4)
    return root / "run"


def _copied(run: Path):
    """The model loaded as before, without `load_trained`: drawn, then the checkpoint's tensors
    copied in."""
    state = load_checkpoint(run / "checkpoint.pt")
    model = lower(scoring_plan(stored_plan(state, str(run))), _spec_of(state, run), "cpu")
    model.load_state_dict(state["model"])
    return model, state


def test_a_loaded_run_holds_the_checkpoint_undrawn_and_looks_up_as_a_copy(run: Path, monkeypatch) -> None:
    model, state = _copied(run)
    drawn = _draws(monkeypatch)
    trained = load_trained(run, "cpu", scoring_plan)
    assert drawn == []  # nothing drawn: every row came from the file
    loaded = trained.model.state_dict()
    assert loaded.keys() == state["model"].keys()
    for key, value in state["model"].items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    seen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    with torch.no_grad():
        for name, module in model.embeddings.items():
            rows = module.weight.shape[0]
            ids = (torch.rand(64 * module.bags_per_sample, generator=seen) ** 3 * rows).long()  # skewed
            offsets = torch.arange(0, ids.numel() + 1)
            got = trained.model.embeddings[name].lookup(ids, offsets)
            assert torch.equal(module.lookup(ids, offsets), got) and float(got.abs().sum()) > 0


def test_eval_of_a_loaded_run_equals_the_copied_models(run: Path, tmp_path: Path) -> None:
    """`flowrec eval` (mapped tensors) gives the metrics of the model the copy path loads."""
    from flowrec.runtime.evaluation.evaluate import predict
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table

    model, _ = _copied(run)
    trained = load_trained(run, "cpu", scoring_plan)
    table = synth_table(trained.spec, 700, SynthConfig(seed=int(torch.randint(0, 2**31 - 1, (1,)))))
    opts = StagingOptions(batch_size=128, shuffle=False, lookahead=0)
    scores = []
    for m in (model, trained.model):
        with iterate_batches(trained.spec, MemorySource(split_table(table, 2)), opts, 0, 0, m.groups) as batches:
            scores.append(predict(m, batches))
    assert np.array_equal(scores[0][0], scores[1][0]) and np.array_equal(scores[0][1], scores[1][1])
    assert float(np.std(scores[0][0])) > 0  # scores that differ by sample


def test_a_damaged_table_is_still_refused_when_mapped(run: Path, tmp_path: Path) -> None:
    """The content check reads the mapped table: one flipped bit in a row is a CheckpointError."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    data = bytearray((bad / "checkpoint.pt").read_bytes())
    table = load_checkpoint(run / "checkpoint.pt")["model"]
    key = max((k for k in table if k.endswith(".weight")), key=lambda k: table[k].numel())
    needle = table[key][7].numpy().tobytes()  # a row of the largest table, as stored
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 5] ^= 0x10
    (bad / "checkpoint.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest"):
        load_trained(bad, "cpu", scoring_plan)


def test_a_resumed_run_is_not_drawn_and_ends_as_an_uninterrupted_one(tmp_path: Path, monkeypatch) -> None:
    runner = CliRunner()
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC)

    def train(*args: str) -> None:
        result = runner.invoke(app, ["train", str(spec), "--rows", "1500", "-q", *args])
        assert result.exit_code == 0, result.output

    train("--out", str(tmp_path / "whole"), "--max-steps", "6")
    train("--out", str(tmp_path / "cut"), "--max-steps", "3")
    drawn = _draws(monkeypatch)
    train("--resume", str(tmp_path / "cut"), "--max-steps", "6")
    assert drawn == []
    a, b = load_checkpoint(tmp_path / "whole" / "checkpoint.pt"), load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert a["position"] == b["position"] and a["position"]["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("fresh", [False, True])
def test_a_run_started_from_another_is_not_drawn(tmp_path: Path, monkeypatch, fresh: bool) -> None:
    """`--init-from` loads the parent's every table (its plan, the same layout): nothing is drawn,
    and the new run starts from the parent's rows (with `--fresh-optimizer`, a fresh sparse state)."""
    runner = CliRunner()
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC)
    parent = tmp_path / "parent"
    result = runner.invoke(app, ["train", str(spec), "--rows", "1500", "-q", "--out", str(parent), "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    drawn = _draws(monkeypatch)
    child = tmp_path / "child"
    args = ["train", str(spec), "--rows", "1500", "-q", "--out", str(child), "--init-from", str(parent),
            "--max-steps", "1"] + (["--fresh-optimizer"] if fresh else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert drawn == []
    before = load_checkpoint(parent / "checkpoint.pt")["model"]
    after = load_checkpoint(child / "checkpoint.pt")["model"]
    tables = [k for k in before if k.endswith(".weight") and k.startswith("embeddings.")]
    assert tables
    for key in tables:  # one step from the parent's rows: the rows it did not touch are the parent's
        same = (before[key] == after[key]).all(dim=1).float().mean()
        assert 0.0 < float(same) < 1.0, key


def test_the_restore_benchmark_runs_quick(tmp_path: Path) -> None:
    """`tools/bench_restore.py --quick` loads both ways and checks they agree (it exits otherwise)."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_restore.py"
    spec = importlib.util.spec_from_file_location("bench_restore", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "restore.json"
    figures = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(figures))
    assert figures["same_state_and_scores"] is True and figures["rounds"] == 1
    assert set(figures["median"]) == {"eval", "resume"} and figures["table_bytes"] == 1_200_040 * 8 * 4


def test_a_ranks_shard_restored_next_is_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row-wise group's shard of a resumed distributed run is allocated, not drawn (the sharded
    checkpoint's shards cover every row once: `flowrec.runtime.checkpoint.shards`); outside the
    context a shard holds this rank's rows of the whole tables' draws."""
    from flowrec.runtime.distributed import sharded

    plain, chunks, drawn = embedding.init_table_rows, sharded.init_table_chunks, []
    monkeypatch.setattr(sharded, "init_table_chunks", lambda table, *a, **k: (drawn.append(table), chunks(table, *a, **k))[1])
    with embedding.restoring_tables():
        shard = sharded.ShardedPackedEmbedding(_group(), world_size=2, rank=1, seed=4)
    assert drawn == [] and shard.weight.shape == (sharded.local_row_count(49, 2, 1), 4)
    drawn_shard = sharded.ShardedPackedEmbedding(_group(), world_size=2, rank=1, seed=4)
    assert sorted(drawn) == ["a", "b"]
    whole = torch.cat([plain("a", 40, 4, seed=4), plain("b", 9, 4, seed=4)])
    mine = torch.arange(49)[sharded.owner_of(torch.arange(49), 2) == 1]
    assert torch.equal(drawn_shard.weight, whole[mine])


PERMUTED = """
name: permuted
features:
  - {name: price, type: dense, transform: log1p}
  - {name: qty, type: dense, transform: log1p}
  - {name: user_id, type: categorical, hash_buckets: 300, dim: 8}
  - {name: item_id, type: categorical, hash_buckets: 700, dim: 8}
  - {name: shop_id, type: categorical, hash_buckets: 90, dim: 8}
modules:
  - {name: deep, kind: mlp, inputs: [shop_id, price, item_id, qty, user_id], layers: [16]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adagrad, lr: 0.1}
training: {batch_size: 128, epochs: 1, eval_every: 0}
"""


def test_a_mapped_model_with_a_permuted_input_gather_scores_and_exports(tmp_path: Path) -> None:
    """A model lowered on meta and assigned the mapped checkpoint (`load_trained(mmap=True)`, what
    `flowrec export` loads) had its column gathers' indices left on meta: exporting a model whose
    MLP reads its packed fields out of order (wide_1000) failed with "found at least two devices,
    cpu and meta". The mapped model now scores as the copied one, and the export is written."""
    spec = tmp_path / "permuted.yaml"
    spec.write_text(PERMUTED)
    flowrec.train(spec, out=tmp_path / "run", rows=1500, max_steps=3)
    copied, _ = _copied(tmp_path / "run")
    mapped = load_trained(tmp_path / "run", "cpu", scoring_plan, mmap=True).model
    assert any(g.inverse is not None for g in mapped.gathers.values())  # the case: a permutation gather
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    dense = torch.rand(64, 2, generator=gen) ** 4 * 9  # skewed
    emb = {g.name: torch.randn(64, g.bags_per_sample, g.dim, generator=gen) * torch.rand(1, 1, g.dim, generator=gen) * 3
           for g in mapped.groups}
    with torch.no_grad():
        want, got = copied.dense_forward(dense, emb, {}), mapped.dense_forward(dense, emb, {})
    assert torch.equal(want, got) and float(want.std()) > 0
    exported = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "pkg" / "model.pt2").is_file()
