"""Delta shards of a distributed run's incremental checkpoints (`runtime.checkpoint_shards`): their
rows go over the base's shards in order, assembled or lazily at any world size, and a delta shard
that does not fit its base is refused with one line naming it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrec.runtime.checkpoint.store import save_checkpoint
from flowrec.runtime.checkpoint.format import CheckpointError
from flowrec.runtime.checkpoint.shards import (DELTA_SHARDS_KEY, SHARDS_DIR, ShardRows, assemble_shards,
                                               manifest, remove_stale_shards, write_shard)
from flowrec.runtime.distributed.groups import owned_rows, owner_of

ROWS, DIM = 13, 3


def base_run(folder: Path, world: int, step: int = 4) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Shards of one group (`g`) saved by `world` ranks at `step`, the state rank 0 would write,
    and the whole tables."""
    gen = torch.Generator().manual_seed(1)
    weight, opt = torch.randn(ROWS, DIM, generator=gen), torch.rand(ROWS, 1, generator=gen)
    files = []
    for rank in range(world):
        rows = owned_rows(ROWS, world, rank)
        part = {"g": {"rows": rows, "weight": weight[rows], "state": opt[rows]}}
        files.append(write_shard(folder, step, rank, world, part, save_checkpoint))
    return {"model": {"ops.w": torch.ones(2)}, "shards": manifest(step, world, files)}, weight, opt


def delta(folder: Path, world: int, step: int, sequence: int, touched: torch.Tensor, weight: torch.Tensor,
          opt: torch.Tensor, seed: int) -> tuple[Path, dict]:
    """Delta `sequence`: rows `touched` get new random values in `weight` / `opt` (in place); each
    rank writes those it owns. Returns (delta manifest path, its shards entry)."""
    gen = torch.Generator().manual_seed(seed)
    weight[touched] = torch.randn(touched.numel(), DIM, generator=gen)
    opt[touched] = torch.rand(touched.numel(), 1, generator=gen)
    files = []
    for rank in range(world):
        rows = touched[owner_of(touched, world) == rank]
        part = {"g": {"rows": rows, "weight": weight[rows].clone(), "state": opt[rows].clone()}}
        files.append(write_shard(folder, step, rank, world, part, save_checkpoint, sequence))
    return folder / f"checkpoint.delta-{sequence:06d}.pt", manifest(step, world, files)


def chain(folder: Path, world: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A base and two deltas (the second overwrites some rows of the first); expected tables."""
    state, weight, opt = base_run(folder, world)
    first = delta(folder, world, 6, 1, torch.tensor([0, 3, 4, 9], dtype=torch.int64), weight, opt, 2)
    second = delta(folder, world, 8, 2, torch.tensor([3, 12], dtype=torch.int64), weight, opt, 3)
    state[DELTA_SHARDS_KEY] = [first, second]
    return state, weight, opt


@pytest.mark.parametrize("world", [1, 2, 3])
def test_delta_shards_go_over_the_base_in_order(tmp_path, world):
    state, weight, opt = chain(tmp_path, world)
    out = assemble_shards(tmp_path / "checkpoint.pt", state)
    assert torch.equal(out["model"]["embeddings.g.weight"], weight)
    assert torch.equal(out["model"]["embeddings.g.state"], opt)
    assert DELTA_SHARDS_KEY not in out and "shards" not in out


@pytest.mark.parametrize("saved, loaded", [(2, 3), (2, 1), (3, 2)])
def test_ranks_load_base_and_delta_rows_without_assembling(tmp_path, monkeypatch, saved, loaded):
    from flowrec.graph.types import GroupField, PackedGroup, TableSlot
    from flowrec.testing.ranks import load_on_ranks

    state, weight, opt = chain(tmp_path, saved)
    out = assemble_shards(tmp_path / "checkpoint.pt", state, lazy=True)
    lazy = out["model"]["embeddings.g.weight"]
    assert isinstance(lazy, ShardRows) and lazy.shape == weight.shape  # the table's rows, not the parts'
    group = PackedGroup("g", DIM, "fp32", ("rowwise_adagrad", 0.1, ()), (TableSlot("t", ROWS, 0),),
                        (GroupField("f", "t", 1, "sum"),))
    monkeypatch.setattr(ShardRows, "whole", lambda self: pytest.fail("a row-wise group assembled a table"))
    for rank, model in enumerate(load_on_ranks(out["model"], group, loaded)):
        mine = owned_rows(ROWS, loaded, rank)
        assert torch.equal(model.embeddings["g"].weight, weight[mine])
        assert torch.equal(model.embeddings["g"].state, opt[mine])


def test_a_delta_shard_of_another_group_or_rows_is_one_line_naming_the_delta(tmp_path):
    state, weight, opt = base_run(tmp_path, 2)
    path, entry = delta(tmp_path, 2, 6, 1, torch.tensor([1, 2], dtype=torch.int64), weight, opt, 2)
    bad = {"h": {"rows": torch.tensor([1]), "weight": torch.zeros(1, DIM), "state": torch.zeros(1, 1)}}
    files = [write_shard(tmp_path, 6, 0, 2, bad, save_checkpoint, 1), (entry["files"][1], entry["digests"][1])]
    with pytest.raises(CheckpointError, match=f"{path.name} does not fit its base: no row-wise group h"):
        assemble_shards(tmp_path / "checkpoint.pt", {**state, DELTA_SHARDS_KEY: [(path, manifest(6, 2, files))]})
    far = {"g": {"rows": torch.tensor([ROWS + 2]), "weight": torch.zeros(1, DIM), "state": torch.zeros(1, 1)}}
    files = [write_shard(tmp_path, 6, 0, 2, far, save_checkpoint, 1), (entry["files"][1], entry["digests"][1])]
    with pytest.raises(CheckpointError, match=f"{path.name} is damaged: rows of group g"):
        assemble_shards(tmp_path / "checkpoint.pt", {**state, DELTA_SHARDS_KEY: [(path, manifest(6, 2, files))]})


def test_a_flipped_bit_in_a_delta_shard_is_refused_naming_it(tmp_path):
    state, weight, opt = chain(tmp_path, 2)
    _, entry = state[DELTA_SHARDS_KEY][1]
    target = tmp_path / SHARDS_DIR / entry["files"][1]
    data = bytearray(target.read_bytes())
    at = data.index(weight[3].numpy().tobytes())  # a byte of a row's weight: the archive stays readable
    data[at] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{target.name} is damaged: its content does not match its digest"):
        assemble_shards(tmp_path / "checkpoint.pt", state)


def test_a_new_full_checkpoint_removes_the_older_delta_shards(tmp_path):
    chain(tmp_path, 2)
    assert len(list((tmp_path / SHARDS_DIR).glob("*-delta*.pt"))) == 4
    keep = base_run(tmp_path, 2, step=10)[0]["shards"]["files"]
    remove_stale_shards(tmp_path, keep)
    assert sorted(p.name for p in (tmp_path / SHARDS_DIR).iterdir()) == sorted(keep)


class _Writer:
    group = None


class _World:
    def __init__(self, rank: int) -> None:
        self.rank, self.size, self.lead = rank, 2, rank == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_lost_after_the_manifest_is_written_names_the_step_a_restart_resumes_from(tmp_path, monkeypatch,
                                                                                          rank):
    # kill -9 of a rank in a commit: rank 0 wrote checkpoint.pt of step 10 and its broadcast failed;
    # the stop line said "the checkpoint of step 5 is kept" while --max-restarts resumed at step 10
    import torch.distributed as dist

    from flowrec.runtime.checkpoint.ranks import RankCheckpointer, RankLost

    def gather(out, mine, group=None):
        out[:] = [mine, ("ok", ("step10-rank1.pt", "d1"))]

    def broadcast(objects, src=0, group=None):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    saver = RankCheckpointer.__new__(RankCheckpointer)
    saver.world, saver._writer, saver.step, saver._unsure = _World(rank), _Writer(), 5, None
    written = []
    with pytest.raises(RankLost):
        saver._commit(10, ("ok", ("step10-rank0.pt", "d0")), lambda files: written.append(files) or "digest")
    if rank == 0:
        assert written and saver.note() == "the checkpoint of step 10 is kept"
    else:  # rank 0 stopped before or after its manifest: both are named
        assert not written and "step 10" in saver.note() and "step 5" in saver.note()


def test_a_damaged_delta_shard_names_the_deltas_whose_removal_leaves_the_state_before_it(tmp_path):
    # the line named the damaged file only: nothing said that removing it (and the deltas after it)
    # leaves the checkpoint before it, which loads
    state, weight, opt = chain(tmp_path, 2)
    first, _ = state[DELTA_SHARDS_KEY][0]
    _, entry = state[DELTA_SHARDS_KEY][0]
    target = tmp_path / SHARDS_DIR / entry["files"][0]
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError) as caught:
        assemble_shards(tmp_path / "checkpoint.pt", state)
    assert (f"removing {first.name} and checkpoint.delta-000002.pt from {tmp_path} leaves the checkpoint "
            f"before it (step 4)") in str(caught.value)
    assert assemble_shards(tmp_path / "checkpoint.pt", {**state, DELTA_SHARDS_KEY: []})["model"]
