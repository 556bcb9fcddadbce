"""Access profiling (FAE): sample the data, count row accesses, size the hot set, simulate caches.

Returns the access profile the planner's cache pass reads::

    {"format": "flowrec-access-profile", "version": 1, "spec": NAME, "sample_rate": r,
     "samples": n, "tables": {TABLE: {"rows", "accesses", "distinct", "hot_cdf", "skew"}},
     "global": {...}, "budget": {...}, "curves": {GROUP: {...}}}

``hot_cdf`` is [[k, share of accesses taken by the k hottest rows], ...] for log-spaced k up to
the distinct rows; ``skew`` the share taken by the hottest 0.1% / 1% / 10% of the table's rows.
The budget section is the FAE hot set: the globally hottest rows (by accesses per byte, row bytes
with optimizer state) that fit the device budget, and the fraction of samples whose ids are all
hot. Curves are hit rates over cache capacity per packed group (`flowrec.data.cachesim`).

Example:
    >>> prof = profile_access(spec, ParquetSource("data/criteo"), budget_bytes=2 << 30)  # doctest: +SKIP
    >>> prof["budget"]["hot_sample_fraction"]  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from flowrec.data.cachesim import batch_trace, capacities_for, hit_rate_curves
from flowrec.data.dataset import PartitionSource
from flowrec.data.pack import column_arrays, pack_group
from flowrec.planner.layout import group_layout
from flowrec.spec.model import ModelSpec

PROFILE_FORMAT = "flowrec-access-profile"
SKEW_FRACTIONS = (0.001, 0.01, 0.1)  # hottest shares of a table's rows
CDF_POINTS = 16  # log-spaced points of hot_cdf
MAX_TRACE = 100_000  # accesses simulated per group (a prefix of the sampled trace)


def sample_rows(spec: ModelSpec, source: PartitionSource, rate: float, seed: int) -> pa.Table:
    """Bernoulli sample of the rows (rate in (0, 1]), seeded per partition, in data order."""
    columns = [f.name for f in spec.sparse_features]
    parts = []
    for i, n in enumerate(source.partition_rows()):
        table = source.submit(i, columns).result()
        if rate < 1.0:
            keep = np.random.default_rng([seed, i]).random(n) < rate
            table = table.filter(pa.array(keep))
        parts.append(table)
    return pa.concat_tables(parts).combine_chunks()


def hot_cdf(counts: np.ndarray) -> list[list[float]]:
    """[[k, share of accesses of the k most accessed rows]] for log-spaced k up to len(counts)."""
    if not len(counts):
        return []
    top = np.cumsum(np.sort(counts)[::-1]) / counts.sum()
    return [[k, float(top[k - 1])] for k in capacities_for(len(counts), CDF_POINTS)]


def skew(counts: np.ndarray, rows: int) -> dict[str, float]:
    """Share of accesses taken by the hottest 0.1% / 1% / 10% of `rows`."""
    top = np.cumsum(np.sort(counts)[::-1]) / max(counts.sum(), 1)
    out = {}
    for frac in SKEW_FRACTIONS:
        k = min(max(int(np.ceil(frac * rows)), 1), len(top))
        out[f"top_{frac * 100:g}%"] = float(top[k - 1]) if len(top) else 0.0
    return out


def profile_access(spec: ModelSpec, source: PartitionSource, sample_rate: float = 0.05, seed: int = 0,
                   budget_bytes: int | None = None, window: int | None = None,
                   batch_size: int | None = None, max_trace: int = MAX_TRACE) -> dict[str, Any]:
    """The access profile of a dataset for a spec (see the module docstring)."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    table = sample_rows(spec, source, sample_rate, seed)
    n = table.num_rows
    groups = group_layout(spec)
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    packed = {g.name: pack_group(g, cols, n) for g in groups}
    tables: dict[str, Any] = {}
    for g in groups:
        ids, _ = packed[g.name]
        for slot in g.tables:
            local = ids[(ids >= slot.row_offset) & (ids < slot.row_offset + slot.rows)]
            _, counts = np.unique(local, return_counts=True)
            tables[slot.table] = {"rows": slot.rows, "accesses": int(counts.sum()),
                                  "distinct": int(len(counts)), "hot_cdf": hot_cdf(counts),
                                  "skew": skew(counts, slot.rows)}
    all_counts = np.concatenate([np.unique(packed[g.name][0], return_counts=True)[1] for g in groups]) \
        if groups else np.zeros(0, np.int64)
    profile = {
        "format": PROFILE_FORMAT, "version": 1, "spec": spec.name, "sample_rate": sample_rate,
        "samples": n, "tables": tables,
        "global": {"accesses": int(all_counts.sum()), "distinct": int(len(all_counts)),
                   "hot_cdf": hot_cdf(all_counts),
                   "skew": skew(all_counts, sum(g.rows for g in groups))},
    }
    budget = budget_bytes if budget_bytes is not None else spec.plan.device_budget_bytes
    if budget is not None:
        profile["budget"] = hot_set(groups, packed, n, budget)
    w = window or spec.plan.window
    bsz = max(1, int(round((batch_size or spec.training.batch_size) * sample_rate)))
    profile["curves"] = {"window": w, "batch_rows": bsz, "groups": {
        g.name: _curves(packed[g.name], g.bags_per_sample, bsz, w, max_trace) for g in groups}}
    return profile


def hot_set(groups, packed: dict[str, tuple[np.ndarray, np.ndarray]], samples: int,
            budget_bytes: int) -> dict[str, Any]:
    """FAE hot set: hottest rows by accesses per byte that fit the budget; all-hot sample share."""
    rows, counts, owner = [], [], []
    for i, g in enumerate(groups):
        r, c = np.unique(packed[g.name][0], return_counts=True)
        rows.append(r)
        counts.append(c)
        owner.append(np.full(len(r), i))
    if not rows:
        return {"bytes": budget_bytes, "hot_rows": {}, "hot_access_share": 0.0, "hot_sample_fraction": 1.0}
    rows_a, counts_a, owner_a = np.concatenate(rows), np.concatenate(counts), np.concatenate(owner)
    row_bytes = np.array([g.row_bytes() for g in groups])[owner_a]
    order = np.lexsort((rows_a, -counts_a / row_bytes))
    fits = np.cumsum(row_bytes[order]) <= budget_bytes
    hot = np.zeros(len(rows_a), bool)
    hot[order[fits]] = True
    all_hot = np.ones(samples, bool)
    per_group = {}
    for i, g in enumerate(groups):
        ids, offsets = packed[g.name]
        mask = owner_a == i
        hot_rows = rows_a[mask][hot[mask]]
        per_group[g.name] = {"rows": int(len(hot_rows)), "bytes": int(len(hot_rows) * g.row_bytes())}
        cold = ~np.isin(ids, hot_rows)
        bag = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        all_hot[bag[cold] // g.bags_per_sample] = False
    return {"bytes": budget_bytes, "hot_rows": per_group,
            "hot_access_share": float(counts_a[hot].sum() / max(counts_a.sum(), 1)),
            "hot_sample_fraction": float(all_hot.mean()) if samples else 1.0}


def _curves(packed: tuple[np.ndarray, np.ndarray], bags_per_sample: int, batch_rows: int,
            window: int, max_trace: int) -> dict[str, Any]:
    ids, offsets = packed
    per_batch = offsets[:: batch_rows * bags_per_sample]
    batches = [ids[a:b] for a, b in zip(per_batch[:-1], per_batch[1:])]
    if offsets[-1] > per_batch[-1]:
        batches.append(ids[per_batch[-1]:])
    trace, which = batch_trace(batches)
    trace, which = trace[:max_trace], which[:max_trace]
    return {"accesses": int(len(trace)), **hit_rate_curves(trace, which, window)}


def plot_profile(profile: dict[str, Any], path: str) -> None:
    """Write a PNG: hot-row CDF per table (left), hit-rate curves of the first group (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    busiest = sorted(profile["tables"].items(), key=lambda kv: -kv[1]["accesses"])[:10]
    for name, t in busiest:
        if t["hot_cdf"]:
            k, share = zip(*t["hot_cdf"])
            left.plot(k, share, label=name)
    left.set(xscale="log", xlabel="hottest rows k", ylabel="share of accesses",
             title="access skew (10 busiest tables)")
    left.legend(fontsize=7)
    groups = profile["curves"]["groups"]
    if groups:
        name, curves = next(iter(groups.items()))
        for policy, rates in curves.items():
            if policy not in ("capacity_rows", "accesses"):
                right.plot(curves["capacity_rows"], rates, marker=".", label=policy)
        right.set(xscale="log", xlabel="cache capacity (rows)", ylabel="hit rate",
                  title=f"hit rate, group {name}")
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
