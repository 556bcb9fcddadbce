"""Managed tables under `flowrec train --nproc 2` (gloo). One shard: every rank steps its replica
of the maps on the global batch's ids and resets the evicted rows it owns. Four virtual shards:
each rank owns two and remaps their ids (`flowrec.runtime.managed_owner`). Either way two ranks
train the parameters and the maps one process trains (with the lookahead cache too), and a
two-rank checkpoint (with deltas) resumes on one process and a one-process one on two ranks."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from flowrec.runtime.checkpoint.format import read_torch_file
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.testing.ranks import assert_same_model, run_flowrec

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess
SPEC = yaml.safe_load(Path(__file__).with_name("test_managed_runs.py").read_text()
                      .split('SPEC = """')[1].split('"""')[0])


def flowrec(*args: str, cwd: Path):
    return run_flowrec(*args, cwd=cwd, root=ROOT, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The managed spec with an odd batch size, plans for 1 and 2 ranks (the managed group row-wise)
    and 700 synthetic rows in 5 files."""
    root = tmp_path_factory.mktemp("dist_managed")
    doc = copy.deepcopy(SPEC)
    doc.update(name="tiny_dist_managed", training={"batch_size": 45, "epochs": 1, "seed": 7})
    doc["tables"][0]["managed"].update(rows=40, every_steps=3)  # full soon: contests every 3 steps
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    for world in (1, 2):
        made = flowrec("plan", "spec.yaml", "--world-size", str(world), "--json", f"p{world}.json", cwd=root)
        assert made.returncode == 0, made.stderr
        plan = json.loads((root / f"p{world}.json").read_text())
        for g in plan["groups"]:
            g["sharding"], g["shards"] = "row_wise", world
        (root / f"p{world}.json").write_text(json.dumps(plan))
    made = flowrec("data", "synth", "spec.yaml", "--rows", "700", "--rows-per-file", "150", "--out", "d",
                   "--seed", "3", "-q", cwd=root)
    assert made.returncode == 0, made.stderr
    return root


def train(work: Path, out: str, nproc: int, *extra: str):
    args = ["train", "spec.yaml", "--data", "d", "--eval-data", "d", "--out", out, "-q", "--device", "cpu", *extra]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    done = flowrec(*args, cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_ranks_train_the_maps_and_rows_one_process_trains(work: Path):
    train(work, "r1", 1, "--plan", "p1.json")
    train(work, "r2", 2, "--plan", "p2.json")
    assert_same_model(work / "r1", work / "r2")
    one, two = load_checkpoint(work / "r1")["model"], load_checkpoint(work / "r2")["model"]
    maps = [k for k in one if k.startswith("managed.")]
    assert maps and all(torch.equal(one[k], two[k]) for k in maps)
    stats = one["managed.users.stats"].tolist()
    assert stats[1] + stats[2] > 0  # rows were evicted or expired, and reset on their owner rank


def test_a_two_rank_checkpoint_resumes_on_one_process(work: Path):
    train(work, "r_full", 1, "--plan", "p1.json")
    train(work, "r_cut", 2, "--plan", "p2.json", "--max-steps", "7", "--checkpoint-full-every", "2",
          "--checkpoint-every", "3")
    resumed = flowrec("train", "spec.yaml", "--resume", "r_cut", "--max-steps", "1000", "-q", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(work / "r_full", work / "r_cut")


@pytest.fixture(scope="module")
def owners(tmp_path_factory) -> Path:
    """The managed table in 4 virtual shards (40 rows: 10 each): under 2 ranks each owns 2 shards
    (rank 0 shards 0 and 2, rank 1 shards 1 and 3) and remaps their ids; plans for 1 and 2 ranks
    (the managed group row-wise) and 700 synthetic rows in 5 files."""
    root = tmp_path_factory.mktemp("dist_owners")
    doc = copy.deepcopy(SPEC)
    doc.update(name="tiny_dist_owners", training={"batch_size": 45, "epochs": 1, "seed": 7})
    doc["tables"][0]["managed"].update(rows=40, every_steps=3, shards=4)
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    for world in (1, 2, 3):
        made = flowrec("plan", "spec.yaml", "--world-size", str(world), "--json", f"p{world}.json", cwd=root)
        assert made.returncode == 0, made.stderr
        plan = json.loads((root / f"p{world}.json").read_text())
        for g in plan["groups"]:
            g["sharding"], g["shards"] = "row_wise", world
        (root / f"p{world}.json").write_text(json.dumps(plan))
    made = flowrec("data", "synth", "spec.yaml", "--rows", "700", "--rows-per-file", "150", "--out", "d",
                   "--seed", "3", "-q", cwd=root)
    assert made.returncode == 0, made.stderr
    return root


def _maps(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_checkpoint(run)["model"].items() if k.startswith("managed.")}


def test_owner_ranks_train_the_shards_and_rows_one_process_trains(owners: Path):
    train(owners, "o1", 1, "--plan", "p1.json")
    two = train(owners, "o2", 2, "--plan", "p2.json", "--checkpoint-full-every", "3", "--checkpoint-every", "4")
    assert_same_model(owners / "o1", owners / "o2")
    one_maps, two_maps = _maps(owners / "o1"), _maps(owners / "o2")
    assert sorted(one_maps) == sorted(f"managed.users.shard{s}.{k}" for s in range(4)
                                      for k in ("keys", "row", "count", "last", "free", "clock", "stats"))
    assert sorted(two_maps) == sorted(one_maps)
    different = [k for k in one_maps if not torch.equal(one_maps[k], two_maps[k])]
    assert not different, different  # the maps bitwise
    stats = sum(one_maps[f"managed.users.shard{s}.stats"] for s in range(4)).tolist()
    assert stats[1] + stats[2] > 0  # rows were evicted or expired, and reset on every rank
    end = [json.loads(x) for x in (owners / "o2" / "metrics.jsonl").read_text().splitlines()][-1]
    one_end = [json.loads(x) for x in (owners / "o1" / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("held", "waiting", "admitted", "evicted", "expired", "shards", "lookups", "default_lookups"):
        assert end["managed"]["tables"]["users"][key] == one_end["managed"]["tables"]["users"][key], key
    assert two.returncode == 0
    raw = read_torch_file(owners / "o2" / "checkpoint.pt", "cpu")  # each rank wrote its own shards' maps
    assert not any(k.startswith("managed.") for k in raw["model"])
    for rank, name in enumerate(raw["shards"]["files"]):
        doc = read_torch_file(owners / "o2" / "checkpoint.shards" / name, "cpu")
        assert sorted({k.split(".")[2] for k in doc["managed"]}) == [f"shard{rank}", f"shard{rank + 2}"]
    # distributed groups take no cache placement; one process under the lookahead cache equals them too
    train(owners, "o1_la", 1, "--cache", "lookahead", "--device-budget", "24KiB")
    plan = json.loads((owners / "o1_la" / "plan.json").read_text())
    assert {g["placement"] for g in plan["groups"]} == {"lookahead"}
    assert_same_model(owners / "o1_la", owners / "o2")
    cached = _maps(owners / "o1_la")
    assert all(torch.equal(cached[k], two_maps[k]) for k in two_maps)


def test_owner_rank_checkpoints_regroup_whole_shards_at_another_world_size(owners: Path):
    train(owners, "o_full", 1, "--plan", "p1.json")
    train(owners, "o_cut2", 2, "--plan", "p2.json", "--max-steps", "7", "--checkpoint-full-every", "2",
          "--checkpoint-every", "3")
    resumed = flowrec("train", "spec.yaml", "--resume", "o_cut2", "--max-steps", "1000", "-q", cwd=owners)
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # 2 ranks -> 1 process
    assert_same_model(owners / "o_full", owners / "o_cut2")
    train(owners, "o_cut1", 1, "--plan", "p1.json", "--max-steps", "7", "--checkpoint-full-every", "2",
          "--checkpoint-every", "3")
    resumed = flowrec("train", "spec.yaml", "--resume", "o_cut1", "--nproc", "2",  # its plan, resharded
                      "--max-steps", "1000", "-q", cwd=owners)
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # 1 process -> 2 ranks
    assert_same_model(owners / "o_full", owners / "o_cut1")
    full, cut = _maps(owners / "o_full"), _maps(owners / "o_cut1")
    assert all(torch.equal(full[k], cut[k]) for k in full)


def test_three_owner_ranks_train_the_shards_and_rows_one_process_trains(owners: Path):
    """3 ranks over 4 shards (rank 0 owns shards 0 and 3, ranks 1 and 2 one each; slices of 15 of
    the 45 samples; the rows row-wise over 3 ranks): the parameters, the maps bitwise and the
    report's totals are one process's; each rank's checkpoint shard holds the maps it owns."""
    if not (owners / "o1" / "checkpoint.pt").is_file():
        train(owners, "o1", 1, "--plan", "p1.json")
    train(owners, "o3", 3, "--plan", "p3.json", "--checkpoint-full-every", "2", "--checkpoint-every", "4")
    assert_same_model(owners / "o1", owners / "o3")
    one_maps, three_maps = _maps(owners / "o1"), _maps(owners / "o3")
    assert sorted(three_maps) == sorted(one_maps) and len(one_maps) == 4 * 7
    different = [k for k in one_maps if not torch.equal(one_maps[k], three_maps[k])]
    assert not different, different
    stats = sum(one_maps[f"managed.users.shard{s}.stats"] for s in range(4)).tolist()
    assert stats[1] + stats[2] > 0  # rows were evicted or expired, and reset on every rank
    ends = [[json.loads(x) for x in (owners / run / "metrics.jsonl").read_text().splitlines()][-1] for run in ("o1", "o3")]
    assert ends[0]["managed"]["tables"]["users"] == ends[1]["managed"]["tables"]["users"]
    raw = read_torch_file(owners / "o3" / "checkpoint.pt", "cpu")
    owned = [sorted({k.split(".")[2] for k in read_torch_file(owners / "o3" / "checkpoint.shards" / name, "cpu")["managed"]})
             for name in raw["shards"]["files"]]
    assert owned == [["shard0", "shard3"], ["shard1"], ["shard2"]], owned

