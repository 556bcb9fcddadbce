"""The profile's predicted share of entirely-hot samples matches what FAE's hot set gives on the
whole dataset (the sample it was chosen on plus the unseen rest)."""
from __future__ import annotations

import numpy as np
import pytest

from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.packed_ids import column_arrays, pack_group
from flowrec.data.profile import profile_access, sample_rows
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.packing import group_layout
from flowrec.spec import spec_from_dict

DOC = {
    "name": "hot",
    "features": [{"name": f"c{i}", "type": "categorical", "hash_buckets": v, "dim": 8}
                 for i, v in enumerate([50, 400, 3000, 20000])],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
}


@pytest.mark.parametrize("rate,budget_rows", [(0.1, 600), (0.25, 2000)])
def test_hot_sample_fraction_prediction_within_5_points(rate, budget_rows):
    spec = spec_from_dict(DOC)
    (group,) = group_layout(spec)
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh data each run
    # 20,000 rows: the 10 % sample's prediction missed by over 5 points once in 35,000 runs (a normal fit
    # to 600 seeds' misses, sd 1.1 points); 40,000 rows: sd 0.8 points, once in billions
    table = synth_table(spec, 40_000, SynthConfig(seed=seed))
    source = MemorySource(split_table(table, 4))
    budget = budget_rows * group.row_bytes()
    predicted = profile_access(spec, source, sample_rate=rate, seed=seed, budget_bytes=budget)["budget"]

    sample = sample_rows(spec, source, rate, seed)
    ids, _ = pack_group(group, {f.name: column_arrays(sample.column(f.name)) for f in spec.sparse_features},
                        sample.num_rows)
    rows, counts = np.unique(ids, return_counts=True)
    hot = rows[np.lexsort((rows, -counts))][:budget_rows]
    all_ids, _ = pack_group(group, {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features},
                            table.num_rows)
    per_sample = np.isin(all_ids, hot).reshape(table.num_rows, group.bags_per_sample)
    measured = per_sample.all(axis=1).mean()
    assert 0.0 < measured < 1.0
    assert abs(predicted["hot_sample_fraction"] - measured) <= 0.05
    assert predicted["hot_sample_fraction_in_sample"] >= predicted["hot_sample_fraction_unseen"]


@pytest.mark.parametrize("budget_rows,target", [(600, "cpu"), (2000, "h100")])
def test_a_runs_profile_plans_exactly_as_the_whole_profile(budget_rows, target):
    """A run's profile (`planner_only`, what `flowrec train --data` samples before planning) leaves
    out the sections for people (the budget's hot set, the simulated cache curves) and nothing the
    planner reads: every other figure is the whole profile's, and the plans made from the two,
    cached placements and their priced traffic included, are the same plan."""
    from flowrec.graph.plan_io import plan_json
    from flowrec.planner.manager import make_plan

    spec = spec_from_dict(DOC)
    (group,) = group_layout(spec)
    seed = int(np.random.default_rng().integers(1 << 30))
    source = MemorySource(split_table(synth_table(spec, 20_000, SynthConfig(seed=seed)), 4))
    budget = budget_rows * group.row_bytes()
    whole = profile_access(spec, source, sample_rate=0.25, seed=seed, budget_bytes=budget)
    run = profile_access(spec, source, sample_rate=0.25, seed=seed, budget_bytes=budget, planner_only=True)
    assert {"budget", "curves"} <= set(whole) and not {"budget", "curves"} & set(run)
    assert run == {k: v for k, v in whole.items() if k not in ("budget", "curves")}
    plans = [make_plan(spec, target=target, device_budget=budget, profile=p) for p in (whole, run)]
    assert any(g.placement != "device" for g in plans[0].meta.groups)  # the budget forces a cached or host group
    assert plan_json(plans[0]) == plan_json(plans[1])


def test_the_startup_benchmark_compares_a_runs_profile_with_the_whole_one(tmp_path):
    """tools/bench_startup.py --quick: both variants start a run on the same data and make the same
    plan and tables (the benchmark stops otherwise); only the earlier one's profile simulates the
    cache curves."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_startup.py"
    module_spec = importlib.util.spec_from_file_location("bench_startup", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    out = bench.main(["--quick", "--json", str(tmp_path / "s.json")])
    assert out["same_plan_and_tables"] and out["table_rows"] == 1_200_040 and out["groups"] == 1
    assert "curves" in out["profile_sections"]["before"] and "curves" not in out["profile_sections"]["now"]
    assert "tables" in out["profile_sections"]["now"]
    assert json.loads((tmp_path / "s.json").read_text())["median"].keys() == {"now", "before"}


def test_reading_the_data_for_the_plan_is_shown_part_by_part(tmp_path, monkeypatch):
    """`flowrec train --data` reads every part of the data for the plan's profile before the first
    step (a 45 M-row dataset: a minute): the run's progress display is given the rows to read and
    then each part's rows as it is read, summing to the dataset's."""
    from contextlib import contextmanager

    from flowrec.runs.plan import sampled_access_profile
    from flowrec.runtime import session

    spec = spec_from_dict(DOC)
    seed = int(np.random.default_rng().integers(1 << 30))
    parts = split_table(synth_table(spec, 20_000, SynthConfig(seed=seed)), 4)
    monkeypatch.setattr(session, "open_dataset", lambda path, spec: MemorySource(parts))
    shown: list = []

    @contextmanager
    def bar(description, total):
        shown.append((description, total))
        yield shown.append
        shown.append("closed")

    profile = sampled_access_profile(spec, str(tmp_path), lambda _: None, bar)
    assert shown == [("sampling the data for the plan", 20_000), *[p.num_rows for p in parts], "closed"]
    assert profile["dataset_rows"] == 20_000
