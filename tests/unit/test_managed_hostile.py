"""Hostile input to managed tables: edited or damaged map states (a checkpoint's arrays, with its
digest recomputed), refused in one line wherever they are loaded; never a traceback, never a map
that gives two ids one row or rows outside the table."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flowrec.data.managed import ManagedMap, ShardedMap, shard_of
from flowrec.runtime.messages import first_line
from flowrec.spec.model import ManagedSpec


def _stepped(spec: ManagedSpec, steps: int = 12):
    """A map (one shard or several) stepped on fresh random Zipf batches, with rows held and free."""
    rng = np.random.default_rng()
    m = ShardedMap(spec) if spec.shards > 1 else ManagedMap(spec)
    for _ in range(steps):
        ids = rng.zipf(1.3, 64).astype(np.int64) * 7919 + int(rng.integers(1, 50))
        m.step(np.where(rng.random(64) < 0.5, -ids, ids))
    return m


def _edit(state: dict, prefix: str, how: str) -> dict:
    """`state` with one hostile edit of the arrays under `prefix` (copies)."""
    out = {k: np.array(v, copy=True) for k, v in state.items()}
    row, free = out[prefix + "row"], out[prefix + "free"]
    held = np.flatnonzero(row != -1)
    unheld = np.flatnonzero(row == -1)
    if how == "row_out_of_range":
        row[held[0]] = 10**6
    elif how == "row_negative":
        row[held[0]] = -5
    elif how == "row_twice":  # an id without a row takes a held one; a free row vanishes
        row[unheld[0]] = row[held[0]]
        out[prefix + "free"] = free[1:]
    elif how == "free_twice":
        free[1] = free[0]
    elif how == "free_unsorted":
        out[prefix + "free"] = free[::-1].copy()
    elif how == "clock_empty":
        out[prefix + "clock"] = np.zeros(0, np.int64)
    elif how == "clock_negative":
        out[prefix + "clock"] = np.array([-3])
    elif how == "stats_empty":
        out[prefix + "stats"] = np.zeros(0, np.int64)
    elif how == "count_nan":
        out[prefix + "count"][0] = np.nan
    elif how == "count_negative":
        out[prefix + "count"][:] = -1.0
    elif how == "last_after_clock":
        out[prefix + "last"][0] = int(out[prefix + "clock"][0]) + 5
    elif how == "keys_unsorted":
        out[prefix + "keys"] = out[prefix + "keys"][::-1].copy()
    elif how == "missing_id":  # raw id 0 (a missing value) holding an entry
        keys = out[prefix + "keys"]
        keys[np.searchsorted(keys, 0) - 1] = 0
        out[prefix + "keys"] = np.sort(keys)
    return out


EDITS = ("row_out_of_range", "row_negative", "row_twice", "free_twice", "free_unsorted", "clock_empty",
         "clock_negative", "stats_empty", "count_nan", "count_negative", "last_after_clock", "keys_unsorted",
         "missing_id")


@pytest.mark.parametrize("how", EDITS)
def test_an_edited_map_state_is_refused_in_one_line(how: str):
    spec = ManagedSpec(rows=400, admit_min_count=2, every_steps=5)
    m = _stepped(spec)
    state = m.state()
    assert 0 < m.occupied < 400 and (state["row"] == -1).any() and (state["keys"] < 0).any() and (state["keys"] > 0).any()
    ManagedMap(spec).load(state)  # the state as written loads
    with pytest.raises(ValueError) as info:
        ManagedMap(spec).load(_edit(state, "", how))
    assert "\n" not in str(info.value) and "managed map" in str(info.value)


@pytest.mark.parametrize("how", ("row_twice", "clock_empty", "stats_empty", "last_after_clock"))
def test_an_edited_shard_is_refused_naming_the_shard(how: str):
    spec = ManagedSpec(rows=900, admit_min_count=2, every_steps=5, shards=3)
    m = _stepped(spec)
    state = m.state()
    ShardedMap(spec).load(state)
    with pytest.raises(ValueError, match="^shard 1 of 3: a managed map") as info:
        ShardedMap(spec).load(_edit(state, "shard1.", how))
    assert "\n" not in str(info.value)


def test_an_id_moved_to_another_shard_is_refused():
    """An id whose arrays sit in a shard it does not hash to would hold a row no lookup finds."""
    spec = ManagedSpec(rows=900, admit_min_count=2, every_steps=5, shards=3)
    state = _stepped(spec).state()
    keys = state["shard0.keys"]
    stranger = next(k for k in range(1, 10**6) if shard_of(np.array([k]), 3)[0] == 1 and k not in keys)
    state["shard0.keys"] = np.sort(np.concatenate([keys[1:], [stranger]]))
    assert shard_of(state["shard0.keys"], 3).tolist().count(1) == 1
    with pytest.raises(ValueError, match="^shard 0 of 3: it holds ids of other shards"):
        ShardedMap(spec).load(state)


def test_shard_clocks_that_are_not_one_number_are_refused():
    """An owner rank loads some shards; the clocks of the others must still be one step count."""
    spec = ManagedSpec(rows=900, admit_min_count=2, every_steps=5, shards=3)
    state = _stepped(spec).state()
    state["shard2.clock"] = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="clock"):
        ShardedMap(spec, owned=(0,)).load(state)


def test_torch_load_errors_keep_their_reason():
    """torch's load_state_dict puts the reason on the line after its header: the one line keeps it."""
    assert first_line(RuntimeError("Error(s) in loading state_dict for M:\n\tmanaged table u: damaged")) \
        == "Error(s) in loading state_dict for M: managed table u: damaged"
    assert first_line(ValueError("bad row\n  details")) == "bad row"
    assert first_line(ValueError("header:")) == "header:"


SPEC = """
name: tiny_managed
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, table: users}
  - {name: item, type: categorical, hash_buckets: 300, dim: 4}
tables:
  - name: users
    dim: 4
    managed: {rows: 300, admit_min_count: 2, evict: lfu, every_steps: 4, shards: 2}
modules:
  - {name: interact, kind: dot, inputs: [user, item]}
  - {name: top, kind: mlp, inputs: [interact, d1], layers: [4]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 16, epochs: 1, seed: 5}
"""


def test_a_checkpoint_with_an_edited_map_is_refused_by_resume_eval_and_export(tmp_path: Path, monkeypatch):
    """The digest is no signature: a checkpoint rewritten with a map giving one row to two ids (or a
    row outside the table) is refused with exit 2 and the reason, by resume, eval and export, and
    by `flowrec.load` with a CheckpointError."""
    import flowrec
    from flowrec.cli import app
    from flowrec.runtime.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(SPEC)
    runner = CliRunner()
    common = ["--rows", "200", "--device", "cpu", "--quiet"]
    result = runner.invoke(app, ["train", "spec.yaml", "--out", "run", "--max-steps", "8", *common])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["data", "synth", "spec.yaml", "--rows", "50", "--out", "ds"]).exit_code == 0
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    model = dict(state["model"])
    for how in ("row_twice", "row_out_of_range"):
        arrays = {k[len("managed.users."):]: v.numpy() for k, v in model.items() if k.startswith("managed.users.")}
        edited = _edit(arrays, "shard0.", how)
        import torch

        body = {k: v for k, v in state.items() if k != "digest"}
        body["model"] = {**model, **{f"managed.users.{k}": torch.from_numpy(v) for k, v in edited.items()}}
        save_checkpoint(tmp_path / "run" / "checkpoint.pt", body)
        for args in (["train", "spec.yaml", "--resume", "run", "--max-steps", "12", "--quiet"],
                     ["eval", "run", "--data", "ds", "--device", "cpu"], ["export", "run", f"pkg_{how}"]):
            result = runner.invoke(app, args)
            assert result.exit_code == 2, (how, args, result.output)
            last = result.output.strip().splitlines()[-1]
            assert "shard 0 of 2: a managed map" in last and "held and free rows" in last, (how, args, result.output)
            assert "Traceback" not in result.output
        assert not (tmp_path / f"pkg_{how}").exists()
        with pytest.raises(CheckpointError, match="shard 0 of 2: a managed map .* held and free rows"):
            flowrec.load(tmp_path / "run", device="cpu")  # the API's error, not torch's RuntimeError


@pytest.mark.parametrize("seed", [18_500_000, 10**10, 2**63 - 1])
def test_sampled_negatives_draw_for_every_seed_of_the_range(seed: int):
    """The draw's generator seed mixes (seed, epoch, batch) modulo 2^64: a spec or --seed above
    about 1.8e7 (the range goes to 2^63-1) crashed every step with torch's overflow; seeds below
    draw what they drew before (checked here at 1.7e7, whose mix is above 2^63)."""
    import torch

    from flowrec.data.negatives import SAMPLE_MIX, NegativeSampler

    probs = torch.rand(50, dtype=torch.float64)
    probs[0] = 0
    big = NegativeSampler("g0", 0, 1, 0, 7, probs, seed)
    items = big.draw(3, 11)
    assert items.shape == (7,) and bool((items > 0).all()) and torch.equal(items, big.draw(3, 11))
    small = NegativeSampler("g0", 0, 1, 0, 7, probs, 17_000_000)
    gen = torch.Generator().manual_seed((17_000_000 * SAMPLE_MIX + 3) * SAMPLE_MIX + 11)
    assert torch.equal(small.draw(3, 11), torch.multinomial(probs.float(), 7, replacement=True, generator=gen))


@pytest.mark.parametrize("shards, says", [(4097, "must be <= 4096"), (1_048_576, "must be <= 4096"),
                                          (0, "must be >= 1"), (2.0, "must be an integer"),
                                          (True, "must be an integer"), ("3", "must be an integer"),
                                          (2_000_001, "must be <= 4096")])
def test_shards_beyond_what_a_step_can_carry_are_refused(shards, says):
    """Every shard steps at every batch (about 20 us each with no ids) and is seven checkpoint
    arrays: a million shards (once valid) made a step take seconds and its maps' build quadratic."""
    from flowrec.spec.validate import validate_document
    import yaml

    doc = yaml.safe_load(SPEC)
    doc["tables"][0]["managed"].update(rows=2_000_000, shards=shards)
    issues = [str(i) for i in validate_document(doc)]
    assert len(issues) == 1 and "tables[0].managed.shards" in issues[0] and says in issues[0], issues
    doc["tables"][0]["managed"]["shards"] = 4096
    assert validate_document(doc) == []


def test_a_quoted_number_is_not_told_about_exponents():
    """The YAML exponent hint is for text such as 1e-3 (YAML 1.1 reads it as text), not for a
    number the user quoted ("3")."""
    from flowrec.spec.validate import validate_document
    import yaml

    doc = yaml.safe_load(SPEC)
    doc["tables"][0]["managed"]["shards"] = "3"
    (issue,) = [str(i) for i in validate_document(doc)]
    assert "must be an integer (got '3')" in issue and "exponent" not in issue
    doc["tables"][0]["managed"]["shards"] = "2e0"
    (issue,) = [str(i) for i in validate_document(doc)]
    assert "YAML reads exponents without a dot as text" in issue


def test_a_failed_owner_exchange_is_one_line_naming_the_exchange():
    """gloo's own timeout on the group (the same seconds as the remapper's deadline) may fire
    first: the collective then completes with gloo's error, which the remapper reports in its own
    one line naming the exchange, with gloo's first line as the reason."""
    from types import SimpleNamespace

    from flowrec.runtime.managed_owner import OwnerRemapper

    class Failed:
        def is_completed(self):
            return True

        def wait(self):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms\nsecond line")

    me = SimpleNamespace(world=SimpleNamespace(timeout_s=3.0), _stopped=lambda: False)
    with pytest.raises(RuntimeError) as err:
        OwnerRemapper._wait(me, Failed(), "id counts")
    text = str(err.value)
    assert text.startswith("managed remap: the exchange of id counts failed (another rank died or stopped): ")
    assert text.endswith("Timed out waiting 3000ms") and "\n" not in text


def _many_managed(shards: list[int | None]) -> dict:
    """A spec of one managed table per entry of `shards` (None: no `shards` key, one shard), each
    read by its own feature."""
    features = [{"name": f"f{i}", "type": "categorical", "table": f"t{i}"} for i in range(len(shards))]
    tables = [{"name": f"t{i}", "dim": 4, "managed": {"rows": 8192, **({} if s is None else {"shards": s})}}
              for i, s in enumerate(shards)]
    return {"name": "many_managed", "features": features, "tables": tables,
            "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
            "heads": [{"name": "ctr", "input": "top"}],
            "optimizer": {"dense": {"name": "sgd", "lr": 0.1}, "sparse": {"name": "sgd", "lr": 0.1}}}


@pytest.mark.parametrize("shards, total, most", [
    ([4096] * 1000, "4,096,000", "tables[0].managed.shards, 4,096"),  # each table within its own bound
    ([2048, 2049], "4,097", "tables[1].managed.shards, 2,049"),
    ([4094, None, 1, None], "4,097", "tables[0].managed.shards, 4,094"),  # a table without shards counts 1
])
def test_the_shards_of_all_managed_tables_together_are_bounded(shards, total, most):
    """Every shard of every table steps at every batch (about 20 to 30 us each, measured by
    tools/bench_managed_shards.py): 1,000 tables of 4,096 shards passed validation and would have
    stepped 4M maps a batch. One issue at `tables`, with the total, the bound and the reason."""
    from flowrec.spec.semantic import MAX_MANAGED_SHARDS
    from flowrec.spec.validate import validate_document

    issues = [(i.path, i.message) for i in validate_document(_many_managed(shards))]
    assert len(issues) == 1 and issues[0][0] == "tables", issues[:3]
    message = issues[0][1]
    assert f"have {total} shards in all" in message and f"more than {MAX_MANAGED_SHARDS:,}" in message, message
    assert "every shard steps at every batch" in message and f"(the most: {most})" in message, message
    assert f"the {len(shards):,} managed tables" in message and "\n" not in message


@pytest.mark.parametrize("shards", [[2048, 2048], [4093, None, 1, None], [4096], [None] * 40])
def test_managed_shards_up_to_the_bound_are_valid(shards):
    from flowrec.spec.validate import validate_document

    assert validate_document(_many_managed(shards)) == []


def test_too_many_shards_in_all_is_one_line_and_exit_2_from_the_cli(tmp_path):
    """`flowrec validate` and `flowrec plan` refuse the spec with its path, nothing planned."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    path = tmp_path / "many.json"
    path.write_text(json.dumps(_many_managed([3000, 3000])))
    for command in (["validate", str(path)], ["plan", str(path), "--json", str(tmp_path / "p.json")]):
        r = CliRunner().invoke(app, command)
        assert r.exit_code == 2, r.output
        assert "tables: the 2 managed tables have 6,000 shards in all" in r.output, r.output
        assert "Traceback" not in r.output
    assert not (tmp_path / "p.json").exists()
