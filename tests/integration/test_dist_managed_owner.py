"""Owner ranks' remap collectives over gloo (2 and 3 processes): each rank remaps its slice of each
global batch through the owners of the ids' shards, and the rows, the freed rows and the owners'
steps equal S plain dict references stepped on the whole batches (fresh Zipf streams); lookups
of the whole batch equal the references' rows; with 3 ranks (uneven slices, a rank owning no
shard of a table) rows, freed rows, lookups, counts and every shard's final map arrays equal one
process's remapper bitwise; a rank that dies, or lives but never takes part, makes the other
fail (within the timeout), never hang.

Each test starts 2 (or 3) processes of this file (`python test_dist_managed_owner.py MODE RANK ...`, a
free port chosen at run time, a timeout on the process group, on every collective and on every
process, every process killed at the end).
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from flowrec.testing.processes import kill_tree, wait_bounded

REPO = Path(__file__).resolve().parents[2]
STEPS, BATCH = 24, 40
START_S = 120  # the rendezvous: a loaded machine starts the processes seconds apart (a 3 s one failed)
RUN_S = 300  # all processes of a test together
SPEC = {
    "name": "owners",
    "features": [{"name": "user", "type": "categorical", "table": "users"},
                 {"name": "item", "type": "categorical", "table": "items"}],
    "tables": [{"name": "users", "dim": 4, "managed": {"rows": 23, "admit_min_count": 2, "evict": "lfu",
                                                       "every_steps": 3, "ttl_steps": 8, "shards": 4}},
               {"name": "items", "dim": 4, "managed": {"rows": 17, "evict": "lru", "every_steps": 2, "shards": 3}}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "sgd", "lr": 0.1}, "sparse": {"name": "sgd", "lr": 0.1}},
}


def spec_doc(mode: str) -> dict:
    """The spec of a mode: SPEC, or for "few" SPEC with 2 item shards (under 3 ranks, rank 2 owns
    no shard of that table: it still sends, receives and resets)."""
    if mode != "few":
        return SPEC
    doc = json.loads(json.dumps(SPEC))
    doc["tables"][1]["managed"]["shards"] = 2
    return doc


def stream(seed: int) -> list[dict[str, np.ndarray]]:
    """Global batches of raw 64-bit ids per table: Zipf ranks over a few hundred values, some missing."""
    rng = np.random.default_rng(seed)
    keys = {t: rng.integers(-(1 << 62), 1 << 62, 300) for t in ("users", "items")}
    out = []
    for _ in range(STEPS):
        batch = {}
        for feature, table in (("user", "users"), ("item", "items")):
            ids = keys[table][np.minimum(rng.zipf(1.3, BATCH) - 1, 299)]
            ids[rng.random(BATCH) < 0.05] = 0
            batch[feature] = ids
        out.append(batch)
    return out


def worker(mode: str, rank: int, world: int, port: int, out: Path, seed: int, timeout_s: float) -> None:
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from flowrec.data.batches import rank_slice
    from flowrec.data.managed import ShardedMap, owner_shards
    from flowrec.graph.packing import group_layout
    from flowrec.runtime.managed_owner import OwnerRemapper
    from flowrec.spec import spec_from_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(timeout_s, START_S)))
    groups = [dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) for _ in range(2)]
    spec = spec_from_dict(spec_doc(mode))
    layout = group_layout(spec)
    where = {t.table: (g.name, t.row_offset) for g in layout for t in g.tables}
    me = SimpleNamespace(size=world, rank=rank, timeout_s=timeout_s)
    maps = {t.name: ShardedMap(t.managed, owned=owner_shards(t.managed.shards, world, rank))
            for t in spec.tables}
    remap = OwnerRemapper(spec, layout, maps, True, me, groups[0])
    if mode == "die" and rank == 1:
        os._exit(0)  # a rank that dies before its first exchange
    if mode == "hang" and rank == 1:
        time.sleep(3 * timeout_s)  # a rank that lives but never takes part
        os._exit(0)
    if mode == "stop":
        stop_between_exchanges(rank, remap, seed)
    report = {"seed": seed, "rows": [], "resets": [], "steps": [], "lookups": [], "where": where, "owned": {t: m.owned for t, m in maps.items()}}
    t0 = time.monotonic()
    try:
        for k, batch in enumerate(stream(seed)):
            lo, hi = rank_slice(BATCH, world, rank)
            cols, done = remap.in_turn(k, lambda: False, lambda: remap.remap({f: v[lo:hi] for f, v in batch.items()}))
            report["rows"].append({f: c.tolist() for f, c in cols.items()})
            report["resets"].append({g: r.tolist() for g, r in done.resets.items()})
            report["steps"].append({t: [u.tolist(), c.tolist()] for t, (u, c) in done.steps.items()})
            look = OwnerRemapper(spec, layout, {t: m.copy() for t, m in remap.maps.items()}, False, me, groups[1])
            cols, _ = look.in_turn(0, lambda: False, lambda: look.remap(dict(batch)))
            report["lookups"].append({f: c.tolist() for f, c in cols.items()})
    except RuntimeError as exc:
        report["error"] = str(exc)
    report["seconds"] = time.monotonic() - t0
    if mode == "seen":  # exclude_seen's training pairs keyed by the users' rows, on every rank
        seen_pairs(report, remap.maps, me)
    np.savez(out / f"maps{rank}.npz", **{f"{t}.{k}": v for t, m in remap.maps.items() for k, v in m.state().items()})
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no teardown collective with a dead peer


def stop_between_exchanges(rank: int, remap, seed: int) -> None:
    """Both ranks' iterators close during batch 1, each in the wait of a different exchange: rank 0
    in its third (rank 1 is slow to post it), rank 1 in its fourth. Rank 0 then still has its turn
    for batch 2, and lives on for 3 s (a run evaluates and checkpoints after training)."""
    import flowrec.runtime.managed_owner as owner

    posted, waits = [0], [0]
    start, wait = owner.start_exchange, remap._wait

    def post(*args):
        if rank == 1 and posted[0] == 6:
            time.sleep(1.0)  # rank 1 is late to post batch 1's third exchange
        posted[0] += 1
        return start(*args)

    def counted_wait(work, what):
        waits[0] += 1
        return wait(work, what)

    owner.start_exchange, remap._wait = post, counted_wait
    lo, hi = (0, BATCH // 2) if rank == 0 else (BATCH // 2, BATCH)
    batches = [{f: v[lo:hi] for f, v in b.items()} for b in stream(seed)]
    closed = (lambda: waits[0] >= 7) if rank == 0 else (lambda: waits[0] >= 8)
    remap.in_turn(0, closed, lambda: remap.remap(batches[0]))
    outcomes = [remap.in_turn(k, closed, lambda k=k: remap.remap(batches[k])) for k in (1, 2)]
    time.sleep(3.0)  # a mismatched exchange from the other rank would abort this process now
    (Path(sys.argv[5]) / f"rank{rank}.json").write_text(json.dumps({"posted": posted[0], "outcomes": outcomes}))
    os._exit(0)


def seen_pairs(report: dict, maps: dict, me) -> None:
    """Every user id of the stream as a (user, item) training pair, keyed by its row through
    evaluation's `_seen_in_rows` (a collective), and each user's row in this rank's own map."""
    from types import SimpleNamespace

    from flowrec.runtime.evaluation.evaluate import _seen_in_rows
    from flowrec.runtime.evaluation.retrieval import SeenItems

    users = np.unique(np.concatenate([b["user"] for b in stream(report["seed"])]))
    users = users[users != 0]
    model = SimpleNamespace(groups=[SimpleNamespace(fields=[SimpleNamespace(feature="user", table="users")])],
                            managed=SimpleNamespace(sync=lambda: None, maps=maps, owners=True, world=me))
    got = _seen_in_rows(model, "user", SeenItems(users, np.arange(1, len(users) + 1)))
    report["seen"] = [got.users.tolist(), got.items.tolist()]
    report["own"] = [users.tolist(), maps["users"].lookup(users).tolist()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, out: Path, seed: int, timeout_s: float, world: int = 2) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, mode, str(r), str(world), str(port), str(out), str(seed),
                               str(timeout_s)], cwd=REPO, env=env, stdout=(out / f"log{r}").open("wb"),
                              stderr=subprocess.STDOUT) for r in range(world)]
    try:
        deadline = time.monotonic() + RUN_S
        codes = [wait_bounded(p, max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    logs = [(out / f"log{r}").read_text(errors="replace")[-3000:] for r in range(world)]
    assert codes == [0] * world, logs
    return [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(world)]


def test_two_owner_ranks_remap_as_the_sharded_dict_reference(tmp_path: Path):
    from flowrec.data.managed import NO_ROW
    from flowrec.data.managed_stage import DROPPED
    from flowrec.spec import spec_from_dict
    from flowrec.testing.managed_ref import ShardedDictMap, dict_shard

    seed = random.randrange(1 << 30)
    ranks = launch("equal", tmp_path, seed, 60)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    spec = spec_from_dict(SPEC)
    refs = {t.name: ShardedDictMap(t.managed) for t in spec.tables}
    table_of = {"user": "users", "item": "items"}
    where = ranks[0]["where"]
    freed = shards_of_rank1 = 0
    for k, batch in enumerate(stream(seed)):
        expected_resets: dict[str, list[int]] = {}
        for f, ids in batch.items():
            t = table_of[f]
            rows, resets = refs[t].step(ids.tolist())
            got = ranks[0]["rows"][k][f] + ranks[1]["rows"][k][f]  # rank 0's slice, then rank 1's
            assert got == [DROPPED if r == NO_ROW else r for r in rows], (seed, k, f)
            group, offset = where[t]
            expected_resets.setdefault(group, []).extend(r + offset for r in resets)
            freed += len(resets)
            held = {i: r for i, r in zip(ids.tolist(), rows) if r != NO_ROW}
            look = [DROPPED if i == 0 or i not in held else held[i] for i in ids.tolist()]
            for r in ranks:  # every rank's lookups of the whole batch, after the step
                assert r["lookups"][k][f] == look, (seed, k, f)
            for rank, r in enumerate(ranks):  # each owner stepped its shards on the global counts
                unique, counts = r["steps"][k][t]
                mine = sorted({i for i in ids.tolist() if i != 0 and dict_shard(i, refs[t].n) % 2 == rank})
                assert unique == mine and counts == [ids.tolist().count(i) for i in mine], (seed, k, t)
                shards_of_rank1 += rank == 1 and len(unique) > 0
        for r in ranks:
            assert {g: sorted(v) for g, v in r["resets"][k].items() if v} == \
                {g: sorted(v) for g, v in expected_resets.items() if v}, (seed, k)
    assert freed > 0 and shards_of_rank1 > 0  # evictions happened and both ranks owned ids
    assert ranks[0]["owned"] == {"users": [0, 2], "items": [0, 2]} and ranks[1]["owned"] == {"users": [1, 3], "items": [1]}


def test_exclude_seen_keys_the_pairs_of_users_on_every_ranks_shards(tmp_path: Path):
    """exclude_seen with a managed user table under --nproc 2: each rank's map holds the rows of its
    own shards only, so the training pairs of users on the other rank's shards were left out of
    every rank's evaluation (nothing excluded for them); now every rank keys every user's pairs
    by the row its owner gave it, as one process does."""
    ranks = launch("seen", tmp_path, random.randrange(1 << 30), 60)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    users, mine0 = ranks[0]["own"]
    _, mine1 = ranks[1]["own"]
    rows = [a if a >= 0 else b for a, b in zip(mine0, mine1)]  # the row of each user, from its owner
    expected = sorted((r, k + 1) for k, r in enumerate(rows) if r >= 0)  # (user row, item) pairs
    assert sum(r >= 0 for r in mine1) > 0 and sum(r >= 0 for r in mine0) > 0  # both ranks own users with rows
    for r in ranks:
        assert sorted(zip(*r["seen"])) == expected


def test_three_owner_ranks_remap_and_step_the_maps_one_process_does(tmp_path: Path):
    """3 owner ranks, uneven slices (14, 13, 13 of 40) and uneven ownership (users: 4 shards, rank 0
    owns 0 and 3; items: 2 shards, rank 2 owns none): each slice's rows, every rank's freed rows and
    lookups of the whole batch, each owner's global counts, and at the end every owned shard's map
    arrays, bitwise equal to one process's `Remapper` over maps of all shards on the whole batches."""
    from flowrec.data.managed import STATE_KEYS, ShardedMap, owner_shards, shard_of
    from flowrec.data.managed_stage import Remapper
    from flowrec.graph.packing import group_layout
    from flowrec.spec import spec_from_dict

    seed = random.randrange(1 << 30)
    ranks = launch("few", tmp_path, seed, 60, world=3)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    spec = spec_from_dict(spec_doc("few"))
    layout = group_layout(spec)
    one = Remapper(spec, layout, {t.name: ShardedMap(t.managed) for t in spec.tables}, train=True)
    freed = 0
    for k, batch in enumerate(stream(seed)):
        cols, done = one.remap(dict(batch))
        look, _ = Remapper(spec, layout, {t: m.copy() for t, m in one.maps.items()}, train=False).remap(dict(batch))
        for f in batch:
            assert sum((r["rows"][k][f] for r in ranks), []) == cols[f].tolist(), (seed, k, f)  # slices in rank order
            assert [r["lookups"][k][f] for r in ranks] == [look[f].tolist()] * 3, (seed, k, f)
        resets = {g: v.tolist() for g, v in done.resets.items() if len(v)}
        freed += sum(len(v) for v in resets.values())
        for rank, r in enumerate(ranks):
            assert {g: sorted(v) for g, v in r["resets"][k].items() if v} == resets, (seed, k, rank)
            for t, m in one.maps.items():
                unique, counts = done.steps[t]
                mine = np.isin(shard_of(unique, len(m.shards)), owner_shards(len(m.shards), 3, rank))
                assert r["steps"][k].get(t, [[], []]) == [unique[mine].tolist(), counts[mine].tolist()], (seed, k, t)
    assert freed > 0  # evictions happened
    assert [r["owned"] for r in ranks] == [{"users": [0, 3], "items": [0]}, {"users": [1], "items": [1]},
                                           {"users": [2], "items": []}]
    whole = {f"{t}.{k}": v for t, m in one.maps.items() for k, v in m.state().items()}
    seen = set()
    for rank in range(3):
        with np.load(tmp_path / f"maps{rank}.npz") as got:
            for key in got.files:
                assert got[key].dtype == whole[key].dtype and np.array_equal(got[key], whole[key]), (seed, rank, key)
            seen |= set(got.files)
    assert seen == set(whole) and len(whole) == len(STATE_KEYS) * (4 + 2)  # every shard's arrays, on its owner


def test_ranks_whose_iterators_close_at_different_exchanges_post_nothing_more(tmp_path: Path):
    """The end of a run under owner ranks: each rank closes its data stage at its own moment, one
    of them between two exchanges of a batch. A closed remapper posts no further collective; it
    used to post the next batch's first exchange where the other rank sent this batch's rows,
    and gloo aborted the process (`op.preamble.length <= op.nbytes`, seen at the end of a
    `--nproc 2` run with incremental checkpoints)."""
    ranks = launch("stop", tmp_path, random.randrange(1 << 30), 30)  # both processes exit 0 (`launch`)
    assert [r["outcomes"] for r in ranks] == [[None, None], [None, None]], ranks  # both closed in batch 1
    assert ranks[0]["posted"] == 7 and ranks[1]["posted"] == 8, ranks  # rank 0 posted nothing after it closed


def test_a_dead_rank_fails_the_owner_exchange_within_the_timeout(tmp_path: Path):
    ranks = launch("die", tmp_path, random.randrange(1 << 30), 3)
    assert ranks[1] is None  # it died without a report
    assert "error" in ranks[0] and ranks[0]["seconds"] < 30, ranks[0]  # gloo sees the closed connection
    assert "Connection" in ranks[0]["error"] or "managed remap: the exchange of" in ranks[0]["error"], ranks[0]["error"]


def test_a_hung_rank_fails_the_owner_exchange_after_the_timeout(tmp_path: Path):
    ranks = launch("hang", tmp_path, random.randrange(1 << 30), 3)
    assert ranks[1] is None and "error" in ranks[0], ranks[0]
    error = ranks[0]["error"]  # our deadline, or gloo's timeout on the group (the same 3 s) first
    assert error.startswith("managed remap: the exchange of id counts "), error
    assert "did not complete within 3 s" in error or "failed (another rank died or stopped)" in error, error
    assert "\n" not in error and 2.9 <= ranks[0]["seconds"] < 30


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    mode, rank, world, port, out, seed, timeout_s = sys.argv[1:8]
    worker(mode, int(rank), int(world), int(port), Path(out), int(seed), float(timeout_s))
