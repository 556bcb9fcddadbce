"""A run samples its training data once at start-up: the planner's access profile keeps FAE's
sample for the hot set (`flowrec.data.profile.sample_rows`' `keep`), which then reads no partition
again. Kept rows are only ever the rows a fresh read would give: same part files (fingerprints),
columns, checks, rate and seed; anything else reads the data."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flowrec.data import convert, profile
from flowrec.data.dataset import MemorySource, ParquetSource, parquet_files, split_table
from flowrec.data.profile import forget_kept_sample, profile_access, sample_rows
from flowrec.data.synth import SynthConfig, synth_dataset, synth_table
from flowrec.graph.kinds import hot_sample_rate
from flowrec.spec import spec_from_dict

ROWS, PER_FILE = 30_000, 8_000  # 4 part files

def _bench():
    """tools/bench_startup_sample.py, loaded as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_startup_sample", Path(__file__).resolve().parents[2] / "tools" / "bench_startup_sample.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


DOC = _bench().QUICK_SPEC  # a 50,000-row packed group of two fields (Zipf ids): 256 KiB plans it static_hot


@pytest.fixture(autouse=True)
def _nothing_kept():
    forget_kept_sample()
    yield
    forget_kept_sample()


def _spec(seed: int):
    return spec_from_dict({**DOC, "training": {**DOC["training"], "seed": seed}})


def _dataset(tmp_path, seed: int):
    """Zipf ids over 4 part files; the spec's seed is random, so samples differ run to run."""
    spec = _spec(seed)
    synth_dataset(spec, tmp_path / "d", ROWS, SynthConfig(seed=seed), rows_per_file=PER_FILE)
    return spec, tmp_path / "d"


class Counted(ParquetSource):
    """A Parquet source that counts the partitions read."""

    def __init__(self, path):
        super().__init__(path)
        self.reads = 0

    def submit(self, index, columns, row_groups=None):
        self.reads += 1
        return super().submit(index, columns, row_groups)


def _fresh(spec, path, rate, seed) -> pa.Table:
    source = Counted(path)
    try:
        table = sample_rows(spec, source, rate, seed)
        assert source.reads == len(parquet_files(path))
        return table
    finally:
        source.close()


def test_the_hot_sets_sample_is_the_profiles_rows_read_once(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    files = len(parquet_files(path))
    rate = hot_sample_rate(ROWS)
    planner = Counted(path)
    try:
        prof = profile_access(spec, planner, seed=seed, keep_sample=True)
    finally:
        planner.close()
    assert planner.reads == files and prof["sample_rate"] == rate
    runtime = Counted(path)  # the trainer opens its own source of the same folder
    try:
        kept = sample_rows(spec, runtime, rate, seed)
        assert runtime.reads == 0  # no partition read again
        again = sample_rows(spec, runtime, rate, seed)  # taken once: the next call reads
        assert runtime.reads == files
    finally:
        runtime.close()
    fresh = _fresh(spec, path, rate, seed)
    assert kept.num_rows == prof["samples"] and kept.num_rows > 1_000
    assert kept.equals(fresh) and again.equals(fresh)


def test_another_seed_rate_or_spec_reads_the_data(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    rate = hot_sample_rate(ROWS)
    # the same data under a larger table: other checks (the same ids pass both)
    larger = spec_from_dict({**DOC, "features": [DOC["features"][0], {**DOC["features"][1], "hash_buckets": 40_000},
                                                 DOC["features"][2]], "training": {"seed": seed}})
    for args in ((spec, rate, seed + 1), (spec, rate / 2, seed), (larger, rate, seed)):
        source = Counted(path)
        try:
            sample_rows(spec, source, rate, seed, keep=True)
            reads = source.reads
            table = sample_rows(args[0], source, args[1], args[2])
            assert source.reads == 2 * reads  # read, not taken
        finally:
            source.close()
        assert table.equals(_fresh(args[0], path, args[1], args[2]))
        forget_kept_sample()


def test_a_file_changed_after_the_profile_is_read_again(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    rate = hot_sample_rate(ROWS)
    source = Counted(path)
    try:
        kept = sample_rows(spec, source, rate, seed, keep=True)
    finally:
        source.close()
    file = parquet_files(path)[2]
    old = pq.read_table(file)
    ids = old.column("a").to_numpy()
    changed = old.set_column(old.column_names.index("a"), "a", pa.array((ids + 7) % 30_000, old.schema.field("a").type))
    pq.write_table(changed, file, row_group_size=pq.ParquetFile(file).metadata.row_group(0).num_rows)
    source = Counted(path)
    try:
        now = sample_rows(spec, source, rate, seed)
        assert source.reads == len(parquet_files(path))  # read: the kept rows are not the data's now
    finally:
        source.close()
    assert not now.equals(kept) and now.num_rows == kept.num_rows
    assert now.equals(_fresh(spec, path, rate, seed))


def test_rows_in_memory_are_never_kept():
    seed = int(np.random.default_rng().integers(1 << 30))
    spec = _spec(seed)
    table = synth_table(spec, 5_000, SynthConfig(seed=seed))
    sample_rows(spec, MemorySource(split_table(table, 2)), 0.5, seed, keep=True)
    assert profile._kept == {}


def test_a_plan_without_a_hot_set_keeps_nothing(tmp_path, monkeypatch):
    """`plan_for_run` keeps the sample only for a plan with a static_hot group (64 KiB: host)."""
    from flowrec.runs.plan import plan_for_run

    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    plan, _ = plan_for_run(spec, "cpu", "64KiB", None, data=str(path))
    assert {g.placement for g in plan.meta.groups} == {"host"} and profile._kept == {}
    plan, _ = plan_for_run(spec, "cpu", "256KiB", None, data=str(path))
    assert {g.placement for g in plan.meta.groups} == {"static_hot"}
    kept = profile._kept["table"]
    forget_kept_sample()
    assert kept.equals(_fresh(spec, path, hot_sample_rate(ROWS), seed))


def test_a_runs_plan_given_again_is_priced_from_the_data_s_sample_as_the_run_was(tmp_path):
    """`flowrec train SPEC --data DIR --plan RUN/plan.json`: the run priced its plan from a sample of
    DIR, the same plan given again was priced by the Zipf model ('access profile none'), so the
    figures it printed were not the run's. Now it samples the data as the run did: the same cost."""
    from flowrec.graph.plan_io import plan_json
    from flowrec.runs.plan import plan_for_run

    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    ran, _ = plan_for_run(spec, "cpu", "256KiB", None, data=str(path))
    forget_kept_sample()
    (tmp_path / "plan.json").write_text(plan_json(ran))
    said: list[str] = []
    again, _ = plan_for_run(spec, "cpu", None, tmp_path / "plan.json", said.append, data=str(path))
    assert again.cost.access_profile.startswith("sampled: ") and again.cost == ran.cost
    assert {g.placement for g in again.meta.groups} == {"static_hot"} and "table" in profile._kept  # for FAE
    forget_kept_sample()
    bare, _ = plan_for_run(spec, "cpu", None, tmp_path / "plan.json", said.append)  # no data: said so
    assert bare.cost.access_profile.startswith("none") and any("priced by the Zipf model" in line for line in said)


def test_a_runs_lookahead_plan_given_again_is_priced_over_the_run_s_epochs(tmp_path):
    """`train --data DIR --plan RUN/plan.json --epochs 2 --max-steps 2` of a lookahead plan priced its
    traffic over the spec's 4 epochs ('lookahead traffic over 4 epochs'), where the run priced it
    over the epochs it trains (one: 2 steps): other figures than the run's. Now the run's epochs."""
    from dataclasses import replace

    from flowrec.graph.plan_io import plan_json
    from flowrec.runs.plan import plan_for_run

    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    spec = replace(spec, plan=replace(spec.plan, cache="lookahead"), training=replace(spec.training, epochs=4))
    ran, _ = plan_for_run(spec, "cpu", "256KiB", None, data=str(path), epochs=2, max_steps=2)
    assert {g.placement for g in ran.meta.groups} == {"lookahead"}
    (tmp_path / "plan.json").write_text(plan_json(ran))
    again, _ = plan_for_run(spec, "cpu", None, tmp_path / "plan.json", data=str(path), epochs=2, max_steps=2)
    assert again.cost == ran.cost and "over 4 epochs" not in again.cost.access_profile


def test_a_run_reads_its_data_once_to_sample_and_trains_as_before(tmp_path, monkeypatch):
    """`flowrec.train` with a static hot set: the sample's partitions are read once (the planner's),
    and the trained tables and hot rows are bitwise those of a run that samples twice."""
    import flowrec

    monkeypatch.setattr(convert, "ROW_GROUP_ROWS", 2_000)
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, path = _dataset(tmp_path, seed)
    checked = []
    real_check = profile.check_partition
    monkeypatch.setattr(profile, "check_partition", lambda t, r, where, *a: (checked.append(where), real_check(t, r, where, *a)))

    def run():
        checked.clear()
        out = flowrec.train(spec, data=str(path), device_budget="256KiB", max_steps=4, device="cpu")
        assert {g.placement for g in out.trained.plan.meta.groups} == {"static_hot"}
        return out, sorted(checked)

    once, reads_once = run()
    assert reads_once == sorted(parquet_files(path))  # each part file sampled once
    monkeypatch.setattr(profile, "_sample_key", lambda *a: None)  # as before: nothing kept
    twice, reads_twice = run()
    assert reads_twice == sorted(parquet_files(path) * 2)
    from flowrec.runtime.caches.static_hot import StaticHotEmbedding

    hot = [(n, m.hot_rows) for n, m in once.trained.model.embeddings.items() if isinstance(m, StaticHotEmbedding)]
    assert hot and all(rows.numel() > 100 for _, rows in hot)  # a hot set was chosen, from the kept rows
    for name, rows in hot:
        assert torch.equal(rows, twice.trained.model.embeddings[name].hot_rows), name
    a, b = once.trained.model.state_dict(), twice.trained.model.state_dict()
    assert a.keys() == b.keys() and len(a) > 2
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_startup_benchmark_reads_each_file_once_kept_and_twice_not(tmp_path):
    """tools/bench_startup_sample.py --quick: both variants start a run with a static hot set; the
    kept one's samples read each part file once, the other's twice."""
    out = _bench().main(["--quick", "--json", str(tmp_path / "s.json")])
    assert out["static_hot_groups"] == 1 and out["part_files"] == 4
    assert out["median"]["kept"]["files_read"] == 4 and out["median"]["read_twice"]["files_read"] == 8
    assert (tmp_path / "s.json").is_file() and profile._kept == {}
