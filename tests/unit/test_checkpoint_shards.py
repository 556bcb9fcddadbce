"""Sharded checkpoints (`runtime.checkpoint_shards`): whole tables put back from the ranks' rows by
the modulo rule, and every damaged, missing or foreign shard refused with one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrec.runtime.checkpoint.store import save_checkpoint
from flowrec.runtime.checkpoint.format import CheckpointError
from flowrec.runtime.checkpoint.shards import (SHARDS_DIR, assemble_shards, manifest, remove_stale_shards,
                                               write_shard)
from flowrec.runtime.distributed.groups import owned_rows

ROWS, DIM = 11, 3


def whole(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=gen), torch.rand(ROWS, 1, generator=gen)


def write_run(folder: Path, world: int, step: int = 4) -> dict:
    """Shards of one group saved by `world` ranks, and the state rank 0 would write."""
    weight, state = whole(step)
    files = []
    for rank in range(world):
        rows = owned_rows(ROWS, world, rank)
        part = {"g": {"rows": rows, "weight": weight[rows], "state": state[rows]}}
        files.append(write_shard(folder, step, rank, world, part, save_checkpoint))
    return {"model": {"ops.w": torch.ones(2)}, "shards": manifest(step, world, files)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_assemble_to_the_whole_tables(tmp_path, world):
    state = write_run(tmp_path, world)
    out = assemble_shards(tmp_path / "checkpoint.pt", state)
    weight, opt = whole(4)
    assert torch.equal(out["model"]["embeddings.g.weight"], weight)
    assert torch.equal(out["model"]["embeddings.g.state"], opt)
    assert "shards" not in out and torch.equal(out["model"]["ops.w"], torch.ones(2))


def test_a_missing_shard_is_one_line(tmp_path):
    state = write_run(tmp_path, 2)
    (tmp_path / SHARDS_DIR / state["shards"]["files"][1]).unlink()
    with pytest.raises(CheckpointError, match="shard .* of rank 1 is missing"):
        assemble_shards(tmp_path / "checkpoint.pt", state)


def test_a_shard_of_another_checkpoint_is_refused(tmp_path):
    state = write_run(tmp_path, 2, step=4)
    other = write_run(tmp_path, 2, step=8)
    state["shards"]["files"][1] = other["shards"]["files"][1]
    with pytest.raises(CheckpointError, match="is not rank 1's shard"):
        assemble_shards(tmp_path / "checkpoint.pt", state)


def test_rows_that_do_not_cover_the_table_once_are_refused(tmp_path):
    weight, state = whole(1)
    rows = torch.tensor([0, 1, 1], dtype=torch.int64)  # row 1 twice, row 2 never
    files = [write_shard(tmp_path, 1, 0, 1, {"g": {"rows": rows, "weight": weight[:3], "state": state[:3]}},
                         save_checkpoint)]
    with pytest.raises(CheckpointError, match="do not hold each of its rows once"):
        assemble_shards(tmp_path / "checkpoint.pt", {"model": {}, "shards": manifest(1, 1, files)})


@pytest.mark.parametrize("entry", [
    {"step": 1, "world_size": 2, "files": ["a.pt"], "digests": ["x"]},
    {"step": 1, "world_size": 1, "files": ["../../etc/passwd"], "digests": ["x"]},
    {"step": "1", "world_size": 1, "files": ["a.pt"], "digests": ["x"]},
    "not a manifest",
])
def test_a_damaged_manifest_is_one_line(tmp_path, entry):
    with pytest.raises(CheckpointError, match="damaged"):
        assemble_shards(tmp_path / "checkpoint.pt", {"model": {}, "shards": entry})


def test_only_the_shards_of_older_checkpoints_are_removed(tmp_path):
    old = write_run(tmp_path, 2, step=4)
    new = write_run(tmp_path, 2, step=8)
    remove_stale_shards(tmp_path, new["shards"]["files"])
    left = sorted(p.name for p in (tmp_path / SHARDS_DIR).iterdir())
    assert left == sorted(new["shards"]["files"]) and not set(left) & set(old["shards"]["files"])


def test_a_whole_checkpoint_takes_the_emptied_shards_folder_away(tmp_path):
    """A 2-rank run resumed with `--resume RUN --nproc 1` (guide.md) wrote a whole checkpoint and
    removed the shards, but left an empty `checkpoint.shards/`, which the run's closing line then
    listed among the run folder's contents; a folder still holding another file is kept."""
    write_run(tmp_path, 2, step=4)
    remove_stale_shards(tmp_path, [])
    assert not (tmp_path / SHARDS_DIR).exists()
    write_run(tmp_path, 2, step=8)
    (tmp_path / SHARDS_DIR / ".ckpt-1.tmp").write_bytes(b"")
    remove_stale_shards(tmp_path, [])
    assert [p.name for p in (tmp_path / SHARDS_DIR).iterdir()] == [".ckpt-1.tmp"]


@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 2), (2, 2), (1, 4)])
def test_ranks_load_their_rows_from_the_shards_without_assembling(tmp_path, monkeypatch, saved, loaded):
    """`lazy=True`: the tables stay as their memory-mapped shards (`ShardRows`, with the whole
    table's shape); each rank of any W' copies exactly its rows by the modulo rule, and a row-wise
    group never assembles the whole table."""
    from flowrec.graph.types import GroupField, PackedGroup, TableSlot
    from flowrec.runtime.checkpoint.shards import ShardRows
    from flowrec.testing.ranks import load_on_ranks

    state = write_run(tmp_path, saved)
    out = assemble_shards(tmp_path / "checkpoint.pt", state, lazy=True)
    lazy_w, lazy_s = out["model"]["embeddings.g.weight"], out["model"]["embeddings.g.state"]
    weight, opt = whole(4)
    assert isinstance(lazy_w, ShardRows) and lazy_w.shape == weight.shape and lazy_w.dtype == weight.dtype
    assert torch.equal(lazy_w.whole(), weight) and torch.equal(lazy_s.whole(), opt)
    group = PackedGroup("g", DIM, "fp32", ("rowwise_adagrad", 0.1, ()), (TableSlot("t", ROWS, 0),),
                        (GroupField("f", "t", 1, "sum"),))
    monkeypatch.setattr(ShardRows, "whole", lambda self: pytest.fail("a row-wise group assembled a table"))
    for rank, model in enumerate(load_on_ranks(out["model"], group, loaded)):
        mine = owned_rows(ROWS, loaded, rank)
        assert torch.equal(model.embeddings["g"].weight, weight[mine])
        assert torch.equal(model.embeddings["g"].state, opt[mine])
        assert torch.equal(model.ops.w, torch.ones(2))


def test_each_ranks_managed_map_shards_join_the_model_state(tmp_path):
    weight, state = whole(2)
    maps = [{"managed.users.shard0.keys": torch.tensor([3, 9]), "managed.users.shard2.keys": torch.tensor([4])},
            {"managed.users.shard1.keys": torch.tensor([-5, 7, 8])}]
    files = []
    for rank in range(2):
        rows = owned_rows(ROWS, 2, rank)
        part = {"g": {"rows": rows, "weight": weight[rows], "state": state[rows]}}
        files.append(write_shard(tmp_path, 2, rank, 2, part, save_checkpoint, managed=maps[rank]))
    out = assemble_shards(tmp_path / "checkpoint.pt", {"model": {"ops.w": torch.ones(2)}, "shards": manifest(2, 2, files)})
    for part in maps:
        for key, value in part.items():
            assert torch.equal(out["model"][key], value)
    assert torch.equal(out["model"]["embeddings.g.weight"], weight)
    bad = [write_shard(tmp_path, 3, 0, 1, {"g": {"rows": torch.arange(ROWS), "weight": weight, "state": state}},
                       save_checkpoint, managed={"embeddings.g.weight": weight[0]})]
    with pytest.raises(CheckpointError, match="its managed maps are not arrays of managed keys"):
        assemble_shards(tmp_path / "checkpoint.pt", {"model": {}, "shards": manifest(3, 1, bad)})
