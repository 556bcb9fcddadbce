"""Managed tables in the spec: validation with paths, round trip, data hash, raw-id encoding."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from flowrec.data.encode import Encoder, needs_fit
from flowrec.data.layout import data_hash
from flowrec.data.raw_ids import MISSING_ID, raw_id_hashes
from flowrec.spec.load import spec_from_dict, to_dict
from flowrec.spec.validate import validate_document

BASE: dict[str, Any] = {
    "name": "mini_managed",
    "features": [
        {"name": "user", "type": "categorical", "table": "users"},
        {"name": "hist", "type": "categorical", "table": "users", "max_len": 3},
        {"name": "item", "type": "categorical", "hash_buckets": 100, "dim": 8},
    ],
    "tables": [{"name": "users", "dim": 8,
                "managed": {"rows": 50, "admit_min_count": 2, "evict": "decayed_lfu", "decay": 0.25,
                            "every_steps": 10, "ttl_steps": 40}}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
}


def _issues(mutate) -> list[tuple[str, str]]:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    return [(i.path, i.message) for i in validate_document(doc)]


def _managed(doc: dict) -> dict:
    return doc["tables"][0]["managed"]


def test_valid_base_round_trips():
    assert validate_document(copy.deepcopy(BASE)) == []
    spec = spec_from_dict(copy.deepcopy(BASE))
    table = spec.table("users")
    assert (table.rows, table.managed.admit_min_count, table.managed.evict) == (50, 2, "decayed_lfu")
    assert (table.managed.decay, table.managed.every_steps, table.managed.ttl_steps) == (0.25, 10, 40)
    assert not table.has_vocab and table.vocab_size == 0
    assert spec_from_dict(to_dict(spec)) == spec
    assert validate_document(to_dict(spec)) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: _managed(d).update(rows=0), ("tables[0].managed.rows", "must be >= 1")),
    (lambda d: _managed(d).update(evict="fifo"), ("tables[0].managed.evict", "must be one of")),
    (lambda d: _managed(d).update(every_steps=0), ("tables[0].managed.every_steps", "must be >= 1")),
    (lambda d: _managed(d).update(decay=1.5), ("tables[0].managed.decay", "must be <= 1")),
    (lambda d: _managed(d).update(ttl_steps=-3), ("tables[0].managed.ttl_steps", "must be >= 1")),
    (lambda d: _managed(d).update(rowz=3), ("tables[0].managed", "unknown key 'rowz'")),
    (lambda d: _managed(d).pop("rows"), ("tables[0].managed", "missing required key 'rows'")),
    (lambda d: d["tables"][0].update(vocab=10), ("tables[0]", "needs exactly one of")),
    (lambda d: d["tables"][0].update(min_freq=2), ("tables[0]", "'min_freq' applies to vocabulary tables only")),
    (lambda d: _managed(d).update(evict="lru"), ("tables[0].managed.decay", "'decay' applies to evict: decayed_lfu")),
    (lambda d: _managed(d).update(shards=0), ("tables[0].managed.shards", "must be >= 1")),
    (lambda d: _managed(d).update(shards=2.5), ("tables[0].managed.shards", "must be an integer")),
    (lambda d: _managed(d).update(shards=51), ("tables[0].managed.shards", "must be <= rows (50)")),
])
def test_bad_managed_settings_name_their_path(mutate, expected):
    issues = _issues(mutate)
    assert any(path == expected[0] and expected[1] in message for path, message in issues), issues


def test_every_problem_at_once():
    def both(d):
        _managed(d).update(rows=0, every_steps=0)
    paths = {p for p, _ in _issues(both)}
    assert {"tables[0].managed.rows", "tables[0].managed.every_steps"} <= paths


def test_shards_round_trip_and_default_to_one():
    assert spec_from_dict(copy.deepcopy(BASE)).table("users").managed.shards == 1
    assert "shards" not in to_dict(spec_from_dict(copy.deepcopy(BASE)))["tables"][0]["managed"]
    doc = copy.deepcopy(BASE)
    _managed(doc)["shards"] = 50  # as many shards as rows: one row each
    assert validate_document(copy.deepcopy(doc)) == []
    spec = spec_from_dict(doc)
    assert spec.table("users").managed.shards == 50 and spec_from_dict(to_dict(spec)) == spec


def test_data_hash_ignores_capacity_but_not_mode():
    small = spec_from_dict(copy.deepcopy(BASE))
    doc = copy.deepcopy(BASE)
    _managed(doc)["rows"] = 5000
    _managed(doc)["shards"] = 7
    assert data_hash(spec_from_dict(doc)) == data_hash(small)
    hashed = copy.deepcopy(BASE)
    hashed["tables"][0] = {"name": "users", "dim": 8, "hash_buckets": 50}
    assert data_hash(spec_from_dict(hashed)) != data_hash(small)


def test_raw_values_keep_a_stable_64_bit_hash():
    spec = spec_from_dict(copy.deepcopy(BASE))
    assert not needs_fit(spec)
    enc = Encoder(spec, {}, {}, {})
    raw = pa.table({"user": pa.array(["u1", "u2", None, "u1", "7"]),
                    "hist": pa.array([["u2", "7"], [], None, ["u1"], ["7", "7"]]),
                    "item": pa.array(["a", "b", "c", "d", "e"]), "label": pa.array([0.0, 1, 0, 1, 0])})
    out = enc.encode(raw)
    user = out.column("user").to_numpy()
    assert user.dtype == np.int64
    assert user[0] == user[3] != user[1] and user[2] == MISSING_ID
    assert user[4] == raw_id_hashes(pa.array([7]))[0]  # an int 7 and a string "7" are one value
    assert np.abs(user[[0, 1, 3]]).max() > 1 << 40  # 64-bit hashes, not rows of a 50-row table
    hist = out.column("hist").combine_chunks()
    assert hist.values.to_numpy().tolist() == [user[1], user[4], user[0], user[4], user[4]]
    again = Encoder(spec, {}, {}, {}).encode(raw.slice(3, 2))
    assert again.column("user").to_numpy().tolist() == user[3:].tolist()  # stable across chunks and runs
    item = out.column("item").to_numpy()
    assert item.min() >= 1 and item.max() < 100  # hashed tables are unchanged


def test_data_checks_take_any_raw_id_but_refuse_nulls_and_non_integers():
    from flowrec.data.checks import check_partition, partition_rules
    from flowrec.data.layout import DataError

    spec = spec_from_dict(copy.deepcopy(BASE))
    rules = [r for r in partition_rules(spec) if r.name in ("user", "hist")]
    ok = pa.table({"user": pa.array([-(1 << 62), 5, 1 << 62], pa.int64()),
                   "hist": pa.array([[-3, 1 << 40], [], [7]], pa.list_(pa.int64()))})
    check_partition(ok, rules, "part-0")
    with pytest.raises(DataError, match="null id at row 1"):
        check_partition(ok.set_column(0, "user", pa.array([1, None, 3], pa.int64())), rules, "part-0")
    with pytest.raises(DataError, match="expected int64"):
        check_partition(ok.set_column(0, "user", pa.array([1.5, 2.0, 3.0])), rules, "part-0")


def test_changes_of_managed_settings_are_named_with_both_values():
    """What `flowrec train --resume / --init-from` says when the spec's managed settings differ
    from the run's (`flowrec.runs.changes`): every changed field with both values, layout or not;
    a table managed on one side only; the generic line when the spec cannot be read."""
    import json

    from flowrec.runs.changes import changed_model_line, managed_changes

    old = spec_from_dict(copy.deepcopy(BASE))
    doc = copy.deepcopy(BASE)
    _managed(doc).update(shards=5, every_steps=20)
    del _managed(doc)["ttl_steps"]
    new = spec_from_dict(doc)
    assert managed_changes(old, old) == []
    phrases = [c.phrase() for c in managed_changes(old, new)]
    assert phrases == [
        "table 'users': managed.every_steps 10 in the run, 20 in the spec (it changes which ids hold rows)",
        "table 'users': managed.ttl_steps 40 in the run, not set in the spec (it changes which ids hold rows)",
        "table 'users': managed.shards 1 in the run, 5 in the spec (it changes the checkpoint's layout: one map per "
        "shard, managed.users.shard<s>.*, and each id's shard and row follow from the count)"], phrases
    hashed = copy.deepcopy(BASE)
    hashed["tables"][0] = {"name": "users", "dim": 8, "hash_buckets": 50}
    (change,) = managed_changes(old, spec_from_dict(hashed))
    assert change.phrase().startswith("table 'users' is managed in the run, not in the spec (it changes the checkpoint's")
    assert change.keep() == "table 'users' managed"
    (change,) = managed_changes(spec_from_dict(hashed), old)
    assert change.phrase().startswith("table 'users' is managed in the spec, not in the run")
    state = {"spec": json.dumps(to_dict(old))}
    line = changed_model_line("runs/a", state, new, starting_from=False)
    assert line.startswith("the spec's model differs from the one the run in runs/a was trained with: table 'users': "
                           "managed.every_steps 10 in the run, 20 in the spec"), line
    assert line.endswith("To go on, keep every_steps: 10 in table 'users', ttl_steps: 40 in table 'users', shards: 1 "
                         "in table 'users' to resume it, or start a new run (another --out) with the new values"), line
    assert "Other parts" not in line
    wider = copy.deepcopy(doc)
    wider["tables"][0]["dim"] = 16  # and a change the managed fields do not explain
    line = changed_model_line("runs/a", state, spec_from_dict(wider), starting_from=True)
    assert "managed.shards 1 in the run, 5 in the spec" in line and "to start from this run" in line, line
    assert line.endswith(". Other parts of the model differ too (compare the spec with runs/a/spec.json)"), line
    for damaged in ({"spec": "{not json"}, {"spec": json.dumps({"name": 3})}, {}):
        assert changed_model_line("runs/a", damaged, new, False) == \
            "the spec's model differs from the one the run in runs/a was trained with"
