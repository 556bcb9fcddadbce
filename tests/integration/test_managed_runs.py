"""Runs with managed tables: the map is saved with the rows in full and incremental checkpoints,
a resumed run ends bitwise equal to an uninterrupted one, eval reads the map."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint

SPEC = """
name: tiny_managed
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, table: users}
  - {name: friends, type: sequence, table: users, max_len: 3, pooling: sum}
  - {name: item, type: categorical, hash_buckets: 3000, dim: 4}
tables:
  - name: users
    dim: 4
    managed: {rows: 200, admit_min_count: 2, evict: lfu, every_steps: 4, ttl_steps: 30}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [4]}
  - {name: interact, kind: dot, inputs: [bottom, user, friends, item]}
  - {name: top, kind: mlp, inputs: [interact, bottom], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 16, epochs: 2, seed: 5}
"""
STEPS = 2 * 38  # 600 rows / 16, 2 epochs
runner = CliRunner()


@pytest.fixture
def spec(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


@pytest.fixture
def sharded(tmp_path: Path, monkeypatch) -> Path:
    """The spec with its managed table split in 3 virtual shards (200 rows: 67, 67, 66)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "sharded.yaml"
    path.write_text(SPEC.replace("ttl_steps: 30}", "ttl_steps: 30, shards: 3}"))
    return path


def _train(spec: Path, out: Path, *args: str):
    result = runner.invoke(app, ["train", str(spec), "--rows", "600", "--out", str(out), "--quiet",
                                 "--checkpoint-every", "5", "--device", "cpu", *args])
    assert result.exit_code == 0, result.output
    return result


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["position"] == b["position"]
    assert a["model"].keys() == b["model"].keys()
    different = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not different, different


def test_checkpoint_holds_rows_and_map_as_one_key_set(spec: Path, tmp_path: Path):
    import json

    result = _train(spec, tmp_path / "run")
    end = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    users = end["managed"]["tables"]["users"]
    assert f"managed users: {users['held']}/200 rows held" in result.output
    assert users["admitted"] - users["evicted"] - users["expired"] == users["held"] <= 200
    assert users["evicted"] + users["expired"] > 0 and 0 < end["managed"]["default_lookup_share"] < 1
    assert users["default_lookups"] == round(end["managed"]["default_lookup_share"] * users["lookups"])
    assert users["lookups"] >= 600 * 2  # one user per row and the friends lists, each epoch
    assert f"{users['default_lookups']:,} of {users['lookups']:,} trained lookups" in result.output
    planned = runner.invoke(app, ["plan", str(spec), "--managed-from", str(tmp_path / "run")])
    assert planned.exit_code == 0, planned.output
    assert f"trained: {users['held']}/200 rows held" in planned.output
    assert f"{users['admitted']:,} admitted, {users['evicted']:,} evicted" in planned.output
    refused = runner.invoke(app, ["plan", str(spec), "--managed-from", str(tmp_path)])
    assert refused.exit_code == 2 and "no metrics.jsonl" in refused.output
    model = load_checkpoint(tmp_path / "run")["model"]
    keys, row, free = (model[f"managed.users.{k}"] for k in ("keys", "row", "free"))
    assert int(model["managed.users.clock"][0]) == STEPS
    held = row[row >= 0]
    assert held.numel() + free.numel() == 200 and held.unique().numel() == held.numel()
    assert keys.numel() > held.numel()  # ids waiting for admission (or evicted) are in the map too
    assert torch.all(keys[1:] > keys[:-1])


def test_sharded_checkpoint_holds_every_shard_as_one_key_set(sharded: Path, tmp_path: Path):
    import json

    result = _train(sharded, tmp_path / "run")
    end = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    users = end["managed"]["tables"]["users"]
    assert users["shards"] == 3 and users["rows"] == 200
    assert f"managed users: {users['held']}/200 rows held" in result.output and "(totals of 3 shards)" in result.output
    assert users["admitted"] - users["evicted"] - users["expired"] == users["held"] <= 200
    assert users["evicted"] + users["expired"] > 0
    model = load_checkpoint(tmp_path / "run")["model"]
    assert not any(k.startswith("managed.users.keys") for k in model)
    held_rows = []
    for s, capacity in enumerate((67, 67, 66)):
        keys, row, free = (model[f"managed.users.shard{s}.{k}"] for k in ("keys", "row", "free"))
        assert int(model[f"managed.users.shard{s}.clock"][0]) == STEPS
        held = row[row >= 0]
        assert held.numel() + free.numel() == capacity and torch.all(keys[1:] > keys[:-1])
        held_rows.append(held * 3 + s)  # the table's rows of the shard
    every = torch.cat(held_rows)
    assert every.unique().numel() == every.numel() == users["held"]
    planned = runner.invoke(app, ["plan", str(sharded), "--managed-from", str(tmp_path / "run")])
    assert planned.exit_code == 0, planned.output
    assert "managed table users: 200 rows in 3 shards, priced at capacity" in planned.output
    assert f"trained: {users['held']}/200 rows held" in planned.output


def test_sharded_resume_ends_bitwise_equal(sharded: Path, tmp_path: Path):
    _train(sharded, tmp_path / "whole", "--checkpoint-full-every", "3")
    run = tmp_path / "parts"
    _train(sharded, run, "--checkpoint-full-every", "3", "--max-steps", "27")
    resumed = runner.invoke(app, ["train", str(sharded), "--resume", str(run), "--max-steps", str(STEPS), "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    _assert_same_run(load_checkpoint(tmp_path / "whole"), load_checkpoint(run))


@pytest.mark.parametrize("full_every", ["1", "3"])
def test_resume_ends_bitwise_equal(spec: Path, tmp_path: Path, full_every: str):
    _train(spec, tmp_path / "whole", "--checkpoint-full-every", full_every)
    run = tmp_path / "parts"
    _train(spec, run, "--checkpoint-full-every", full_every, "--max-steps", "27")
    assert int(load_checkpoint(run)["model"]["managed.users.clock"][0]) in (25, 27)
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", str(STEPS), "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    _assert_same_run(load_checkpoint(tmp_path / "whole"), load_checkpoint(run))


def test_eval_reads_the_map(spec: Path, tmp_path: Path):
    _train(spec, tmp_path / "run")
    run = tmp_path / "run"
    data = tmp_path / "synth"
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "300", "--out", str(data), "--seed", "9"])
    assert made.exit_code == 0, made.output
    scored = runner.invoke(app, ["eval", str(run), "--data", str(data), "--json", str(tmp_path / "m.json")])
    assert scored.exit_code == 0, scored.output
    assert "auc" in (tmp_path / "m.json").read_text()


@pytest.mark.parametrize("shards", [1, 3])
def test_export_then_predict_equals_eval_on_unseen_evicted_and_admitted_ids(spec: Path, sharded: Path,
                                                                           tmp_path: Path, shards: int):
    import numpy as np
    import pyarrow.parquet as pq

    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.managed import NO_ROW
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.managed_state import eval_remapper
    from flowrec.serving.predict import load_model
    from flowrec.serving.trained import load_trained
    from flowrec.runtime.session import open_dataset

    run, data, pkg = tmp_path / "run", tmp_path / "synth", tmp_path / "pkg"
    spec = spec if shards == 1 else sharded
    _train(spec, run)
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "400", "--out", str(data), "--seed", "9"])
    assert made.exit_code == 0, made.output
    exported = runner.invoke(app, ["export", str(run), str(pkg)])
    assert exported.exit_code == 0, exported.output
    trained = load_trained(run, "cpu", scoring_plan)
    users = trained.model.managed.maps["users"]
    assert len(getattr(users, "shards", [users])) == shards
    rows = pq.read_table(data)
    ids = rows.column("user").to_numpy()
    known = np.isin(ids, users.entries().keys)
    held = users.lookup(ids) != NO_ROW
    assert held.any() and (known & ~held).any() and (~known).any()  # admitted, waiting/evicted, unseen
    source = open_dataset(data, trained.spec)
    opts = StagingOptions(batch_size=64, shuffle=False, lookahead=0)
    with torch.no_grad(), iterate_batches(trained.spec, source, opts, 0, 0, trained.model.groups,
                                          remap=eval_remapper(trained.model)) as batches:
        expected = torch.cat([torch.sigmoid(trained.model(b)) for b in batches]).numpy()
    source.close()
    scores = load_model(pkg).score_encoded(rows)
    assert scores.shape == expected.shape
    assert float(np.abs(scores - expected).max()) == 0.0
    (pkg / "managed" / "users.parquet").write_bytes(b"not parquet")  # a damaged map is refused before it is read
    with pytest.raises(ValueError, match=r"managed/users\.parquet does not match the digest its manifest records"):
        load_model(pkg)


def test_a_lookahead_cache_run_equals_a_resident_run(spec: Path, tmp_path: Path):
    import json

    _train(spec, tmp_path / "resident", "--max-steps", "30")
    cached = _train(spec, tmp_path / "cached", "--max-steps", "30", "--device-budget", "20KiB", "--cache", "lookahead")
    plan = json.loads((tmp_path / "cached" / "plan.json").read_text())
    assert {g["placement"] for g in plan["groups"]} == {"lookahead"}, cached.output
    a, b = load_checkpoint(tmp_path / "resident")["model"], load_checkpoint(tmp_path / "cached")["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_a_half_precision_export_compares_on_remapped_eval_rows(spec: Path, tmp_path: Path):
    import json

    for name, seed in (("train", "3"), ("test", "4")):
        made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "400", "--out", str(tmp_path / name),
                                   "--seed", seed])
        assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    trained = runner.invoke(app, ["train", str(spec), "--data", str(tmp_path / "train"), "--eval-data",
                                  str(tmp_path / "test"), "--out", str(run), "--quiet", "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    exported = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg"), "--dtype", "bf16"])
    assert exported.exit_code == 0, exported.output
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert manifest["half_max_score_diff"]["rows"] == 400 and manifest["half_max_score_diff"]["value"] < 0.05


def test_plan_shows_managed_tables_at_capacity(spec: Path):
    shown = runner.invoke(app, ["plan", str(spec)])
    assert shown.exit_code == 0, shown.output
    assert "managed table users: 200 rows, priced at capacity; admit at 2, lfu every 4 steps, ttl 30 steps" \
        in shown.output
    assert "3,200" in shown.output  # the packed group's rows: 200 managed + 3,000 hashed


def test_plan_shows_the_owner_ranks_of_virtual_shards(sharded: Path, spec: Path):
    shown = runner.invoke(app, ["plan", str(sharded), "--world-size", "2"])
    assert shown.exit_code == 0, shown.output
    assert "managed table users: 200 rows in 3 shards, priced at capacity" in shown.output
    assert "under 2 ranks: rank w owns the shards s % 2 == w (2, 1 shards) and remaps their ids" in shown.output
    shown = runner.invoke(app, ["plan", str(sharded), "--world-size", "5"])
    assert shown.exit_code == 0, shown.output
    assert "(1, 1, 1, 0, 0 shards) and remaps their ids; ranks 3 to 4 own none of its shards" in shown.output
    replicas = runner.invoke(app, ["plan", str(spec), "--world-size", "2"])
    assert replicas.exit_code == 0 and "under 2 ranks" not in replicas.output  # one shard: replicas, as before


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time (ns); the folder's lock file
    (which the process that claims the folder rewrites with its pid) by its bytes only."""
    return {str(p.relative_to(folder)): (p.read_bytes(), 0 if p.name == ".flowrec.lock" else p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_with_other_shards_names_the_table_and_both_counts(sharded: Path, tmp_path: Path):
    """A resume whose spec changes managed.shards (the checkpoint's map keys) said only "the spec's
    model differs": it names the table, both counts and what to do; exit 2, the run untouched.
    Rows (also the layout) and a rule (not the layout) are named with both values too."""
    run = tmp_path / "run"
    _train(sharded, run, "--max-steps", "10")
    before = _files(run)
    assert "checkpoint.pt" in before
    cases = [
        ("shards: 3}", "shards: 4}", ["table 'users': managed.shards 3 in the run, 4 in the spec (it changes the "
                                     "checkpoint's layout: one map per shard, managed.users.shard<s>.*",
                                     "To go on, keep shards: 3 in table 'users' to resume it, or start a new run "
                                     "(another --out) with the new value"]),
        ("ttl_steps: 30, shards: 3}", "ttl_steps: 30}", ["managed.shards 3 in the run, 1 in the spec"]),
        ("rows: 200, admit_min_count: 2, evict: lfu", "rows: 240, admit_min_count: 2, evict: lru",
         ["table 'users': managed.rows 200 in the run, 240 in the spec (it changes the checkpoint's layout: the "
          "table's rows", "; table 'users': managed.evict lfu in the run, lru in the spec (it changes which ids "
          "hold rows)", "keep rows: 200 in table 'users', evict: lfu in table 'users' to resume it",
          "with the new values"]),
    ]
    for old, new, says in cases:
        changed = tmp_path / "changed.yaml"
        changed.write_text(sharded.read_text().replace(old, new))
        assert changed.read_text() != sharded.read_text()
        r = runner.invoke(app, ["train", str(changed), "--resume", str(run), "--quiet", "--device", "cpu",
                                "--max-steps", "20"])
        assert r.exit_code == 2, r.output
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: the spec's model differs from the one the run in {run} was trained with: "), line
        assert all(s in line for s in says), (line, says)
        assert "Traceback" not in r.output
        assert _files(run) == before  # nothing written, replaced or added
    r = runner.invoke(app, ["train", str(changed), "--init-from", str(run), "--out", str(tmp_path / "child"),
                            "--quiet", "--device", "cpu", "--rows", "600"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert "managed.rows 200 in the run, 240 in the spec" in line and "to start from this run, or train without " \
           "--init-from" in line, line
    assert _files(run) == before
