"""A rank's initial rows of a row-wise sharded group (`initial_local_rows`) are bitwise those one
process draws, and drawing them holds the rank's share plus one chunk, never a whole table: two
ranks of `flowrec train --nproc 2` drew every table whole (and its packed ids in int64), about five
times a rank's share each, and a table that fit the host had both killed by the out-of-memory
killer before training."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from flowrec.testing.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]


def _group(sizes: list[int], dim: int) -> PackedGroup:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    slots = tuple(TableSlot(f"t{i}", rows, offset) for i, (rows, offset) in enumerate(zip(sizes, offsets)))
    return PackedGroup("g", dim, "fp32", ("sgd", 0.1, ()), slots, (GroupField("f", "t0", 1, "sum"),))


def test_the_ranks_rows_are_one_process_rows_whatever_the_chunk(monkeypatch) -> None:
    from flowrec.runtime.distributed import sharded
    from flowrec.runtime.distributed.groups import owned_rows
    from operators.embedding import init_table_rows

    sizes = [random.randrange(1, 60) for _ in range(random.randrange(1, 4))]
    dim, seed = random.randrange(1, 6), random.randrange(1 << 30)
    group = _group(sizes, dim)
    whole = torch.cat([init_table_rows(f"t{i}", rows, dim, seed) for i, rows in enumerate(sizes)])
    for world, chunk in [(w, c) for w in (1, 2, 3) for c in (1, random.randrange(2, 20))]:
        monkeypatch.setattr(sharded, "INIT_CHUNK_ROWS", chunk)  # a chunk of fewer rows than ranks included
        for rank in range(world):
            local = sharded.initial_local_rows(group, world, rank, seed, torch.float32)
            assert torch.equal(local, whole[owned_rows(sum(sizes), world, rank)]), (world, rank)


def test_a_rank_draws_its_share_without_holding_a_whole_table() -> None:
    # peak memory of rank 0 of 2 drawing a 2^24-row dim-4 table (256 MiB whole, 128 MiB its share):
    # about 700 MiB above the start when it drew the whole table
    rows, dim = 1 << 24, 4
    code = (f"import resource, torch; from flowrec.graph.types import GroupField, PackedGroup, TableSlot; "
            f"from flowrec.runtime.distributed.sharded import initial_local_rows; "
            f"g = PackedGroup('g', {dim}, 'fp32', ('sgd', 0.1, ()), (TableSlot('t0', {rows}, 0),), "
            f"(GroupField('f', 't0', 1, 'sum'),)); before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            f"out = initial_local_rows(g, 2, 0, 3, torch.float32); assert out.shape == ({rows // 2}, {dim}); "
            f"print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)")
    done = run_bounded([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout_s=300,
                       env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    grew = int(done.stdout.split()[-1])
    assert grew < rows * dim * 4, f"{grew / 2**20:.0f} MiB above the start"  # less than the whole table
