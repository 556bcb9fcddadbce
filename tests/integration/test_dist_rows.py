"""Sharded packed groups without processes: the shards of every world size partition the table,
their initial rows are bitwise one process's table, shards saved at one world size load at
another with the same rows and optimizer state, and the exchange schedule interleaves groups."""
from __future__ import annotations

import pytest
import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from flowrec.runtime.distributed import ShardedPackedEmbedding, local_row_count, owned_rows
from flowrec.runtime.distributed.schedule import drive
from operators.embedding import PackedEmbeddingBag
from operators.random_batches import random_batch


def make_group(dtype: str = "fp64", optimizer: str = "adam") -> PackedGroup:
    tables = (TableSlot("a", 11, 0), TableSlot("b", 1, 11), TableSlot("c", 5, 12))  # 17 rows
    fields = (GroupField("x", "a", 3, "mean"), GroupField("y", "b", 1, "sum"), GroupField("z", "c", 2, "none"))
    return PackedGroup(name="g", dim=3, dtype=dtype, optimizer=(optimizer, 0.1, ()), tables=tables,
                       fields=fields)


def assemble(shards: list[ShardedPackedEmbedding]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole table and state from the shards of every rank."""
    first = shards[0]
    weight = torch.full((first.group.rows, first.dim), float("nan"), dtype=first.weight.dtype)
    state = torch.full((first.group.rows, first.state.shape[1]), float("nan"), dtype=first.state.dtype)
    for shard in shards:
        packed, w, s = shard.shard_rows()
        weight[packed], state[packed] = w, s
    return weight, state


@pytest.mark.parametrize("world", [1, 2, 3, 4, 17, 20])
def test_owned_rows_partition_the_table(world):
    rows = make_group().rows
    owned = torch.cat([owned_rows(rows, world, r) for r in range(world)])
    assert sorted(owned.tolist()) == list(range(rows))
    assert [local_row_count(rows, world, r) for r in range(world)] == [len(owned_rows(rows, world, r))
                                                                      for r in range(world)]


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "fp16"])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 20])
def test_initial_shards_are_bitwise_the_single_process_table(world, dtype):
    group = make_group(dtype)
    weight, _ = assemble([ShardedPackedEmbedding(group, world, r, seed=7) for r in range(world)])
    assert torch.equal(weight, PackedEmbeddingBag(group, seed=7).weight)


@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 1), (1, 2), (4, 2)])
def test_shards_reshard_to_any_world_size(saved, loaded):
    group = make_group()
    trained = PackedEmbeddingBag(group, seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # rows and lazy-Adam state away from their initial values
        batch = random_batch(group, 8, gen)
        trained(batch.ids, batch.offsets).sum().backward()
    old = [ShardedPackedEmbedding(group, saved, r, seed=1) for r in range(saved)]
    everything = torch.arange(group.rows)
    for shard in old:
        assert shard.load_rows(everything, trained.weight, trained.state) == shard.weight.shape[0]
    files = [shard.shard_rows() for shard in old]  # what each rank would write
    new = [ShardedPackedEmbedding(group, loaded, r, seed=2) for r in range(loaded)]
    for shard in new:
        assert sum(shard.load_rows(*f) for f in files) == shard.weight.shape[0]
    weight, state = assemble(new)
    assert torch.equal(weight, trained.weight) and torch.equal(state, trained.state)


def test_load_rows_rejects_rows_outside_the_group():
    shard = ShardedPackedEmbedding(make_group(), 2, 0)
    with pytest.raises(ValueError, match="outside"):
        shard.load_rows(torch.tensor([0, 17]), torch.zeros(2, 3), torch.zeros(2, 7))


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2"):
        ShardedPackedEmbedding(make_group(), 2, 2)


class _Work:
    """A collective's work handle that records when it is waited for."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _steps(log: list[str], group: str, waits: int):
    for k in range(waits):
        log.append(f"start {group}{k}")
        yield _Work(log, f"{group}{k}")
    log.append(f"done {group}")
    return group.upper()


def test_interleaved_schedule_starts_every_group_before_waiting():
    log: list[str] = []
    assert drive([_steps(log, "a", 2), _steps(log, "b", 2)], interleave=True) == ["A", "B"]
    assert log == ["start a0", "start b0", "wait a0", "start a1", "wait b0", "start b1",
                   "wait a1", "done a", "wait b1", "done b"]


def test_plain_schedule_runs_one_group_after_another():
    log: list[str] = []
    assert drive([_steps(log, "a", 2), _steps(log, "b", 1)], interleave=False) == ["A", "B"]
    assert log == ["start a0", "wait a0", "start a1", "wait a1", "done a",
                   "start b0", "wait b0", "done b"]
