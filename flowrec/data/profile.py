"""Access profiling (FAE): sample the data, count row accesses, size the hot set, simulate caches.

Returns the access profile the planner's cache pass reads::

    {"format": "flowrec-access-profile", "version": 1, "spec": NAME, "sample_rate": r,
     "samples": n, "dataset_rows": N, "tables": {TABLE: {"rows", "accesses", "distinct", "hot_cdf",
     "hit_cdf", "unseen", "skew", "dataset_distinct", "dataset_counts"}},
     "global": {...}, "budget": {...}, "curves": {GROUP: {...}}}

``dataset_rows`` is the rows the sample was drawn from (profiles written before it existed: about
``samples / sample_rate``). A table's ``dataset_distinct`` is the rows of it the whole data reads
and ``dataset_counts`` how often: [[c, rows read c times], ...] (c exact up to 16, then the mean of
geometric bins), counted while the data is read for the sample; the lookahead cache's traffic is
priced from them (`flowrec.planner.access.EpochCounts`). Absent for managed tables, for groups over
`MAX_COUNTED_ROWS` rows and in older profiles.

``hot_cdf`` is [[k, share of the sample's accesses taken by its k most counted rows], ...] for
log-spaced k up to the distinct rows; ``skew`` the share taken by the hottest 0.1% / 1% / 10% of
the table's rows. A sample over-rates the rows it saw: on all the data, the rows it counted once
take less than their count says, and rows it never saw take the rest. ``hit_cdf`` (same k) is the
share of *all* the data's accesses those k rows take, and ``unseen`` the share of the rows the sample
missed and an estimate of how many they are: Good-Turing's estimates, corrected for a Bernoulli
sample of a finite dataset at rate r (`good_turing`); a sample of every row (r = 1) misses nothing.
The planner prices a static hot set (FAE: the rows its own, larger sample counted) from these.
The budget section is the FAE hot set: the globally hottest rows (by accesses per byte, row bytes
with optimizer state) that fit the device budget, and the fraction of samples whose ids are all
hot. Curves are hit rates over cache capacity per packed group (`flowrec.data.cachesim`).

Example:
    >>> prof = profile_access(spec, ParquetSource("data/criteo"), budget_bytes=2 << 30)  # doctest: +SKIP
    >>> prof["budget"]["hot_sample_fraction"]  # doctest: +SKIP
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from numba import njit

from flowrec.data.cachesim import batch_trace, capacities_for, hit_rate_curves
from flowrec.data.checks import check_partition, partition_rules
from flowrec.data.dataset import PartitionSource, partition_name
from flowrec.data.managed_stage import fold_raw_ids
from flowrec.data.packed_ids import column_arrays, pack_group
from flowrec.graph.kinds import hot_sample_rate
from flowrec.graph.packing import group_layout
from flowrec.spec.model import ModelSpec

PROFILE_FORMAT = "flowrec-access-profile"
SKEW_FRACTIONS = (0.001, 0.01, 0.1)  # hottest shares of a table's rows
CDF_POINTS = 16  # log-spaced points of hot_cdf
MAX_TRACE = 100_000  # accesses simulated per group (a prefix of the sampled trace)
MAX_WINDOW = 1024  # the lookahead window's largest value in batches: the spec's plan.window (its schema's maximum);
# a larger --window overflowed the cache simulation (2**63 - 1: a segmentation fault, beyond: numba's traceback)
HOT_FOLDS = 5  # cross-validation folds of the hot-sample estimate (choose on 4/5, score 1/5)
GT_MAX_COUNT = 5  # Good-Turing adjusts rows counted 1..5 times; counts above it are their own estimate
MIN_SAMPLE_ROWS = 1_000  # fewer sampled rows: skew and hot-set figures are noise
MIN_CURVE_BATCHES = 20  # fewer sampled batches: the cache simulation has nothing to reuse across
MAX_COUNTED_ROWS = 1 << 26  # larger groups: reads of each row of the whole data are not counted (4 bytes a row)
EXACT_COUNTS = 16  # dataset_counts: reads counted exactly up to this many, then in geometric bins
COUNT_BIN_RATIO = 1.5
PLOTTED_TABLES = 10  # tables on the skew plot and in the CLI's list: those with the most distinct rows


_kept_lock = threading.Lock()
_kept: dict[str, Any] = {}  # {"key": what decided the rows, "table": the sample}: at most one, taken once


def _sample_key(spec: ModelSpec, source: PartitionSource, rate: float, seed: int) -> tuple | None:
    """What decides a sample's rows: the part files and their fingerprints (size, mtime, footer),
    the columns and their checks, the rate and the seed. None: a source without part files (memory)
    or with a file that cannot be fingerprinted; such samples are never kept."""
    files, prints = getattr(source, "files", None), getattr(source, "fingerprints", None)
    if files is None or prints is None:
        return None
    marks = tuple(prints())
    if not marks or "" in marks:
        return None
    columns = tuple(f.name for f in spec.sparse_features)
    return (tuple(str(f) for f in files), marks, columns, partition_rules(spec, columns), float(rate), int(seed))


def forget_kept_sample() -> None:
    """Drop the sample `sample_rows(..., keep=True)` kept, if nobody took it (frees its memory)."""
    with _kept_lock:
        _kept.clear()


def _take_kept(spec: ModelSpec, source: PartitionSource, rate: float, seed: int) -> pa.Table | None:
    """The kept sample when it is the one these arguments draw (it is then no longer kept), else
    None; with nothing kept, no file is fingerprinted."""
    if not _kept:
        return None
    key = _sample_key(spec, source, rate, seed)
    with _kept_lock:
        if key is None or _kept.get("key") != key:
            return None
        table = _kept["table"]
        _kept.clear()
        return table


def sample_rows(spec: ModelSpec, source: PartitionSource, rate: float, seed: int,
                visit: Callable[[pa.Table], None] | None = None, keep: bool = False,
                progress: Callable[[int], None] | None = None) -> pa.Table:
    """Bernoulli sample of the rows (rate in (0, 1]), seeded per partition, in data order.
    `visit` is called with every whole partition (its id columns, checked) before it is sampled,
    `progress` with the rows of each partition once it is read (not for a kept sample: nothing is
    read).

    A run samples its training data twice at start-up: the planner's access profile, then FAE's
    hot set (`assign_hot_rows`), the same rows (same files, rate and seed). `keep` keeps this sample
    for the next call without `visit` whose files (by fingerprint), columns, checks, rate and seed
    are the same; that call takes it instead of reading every partition again. One sample is kept
    at a time, taken once (`forget_kept_sample` drops it). A file changed in between is read again.

    Raises:
        DataError: an id outside its table (`flowrec.data.checks`), naming partition, column and row.
    """
    if visit is None:
        kept = _take_kept(spec, source, rate, seed)
        if kept is not None:
            return kept
    key = _sample_key(spec, source, rate, seed) if keep else None
    columns = [f.name for f in spec.sparse_features]
    rules = partition_rules(spec, columns)
    parts = []
    sizes = source.partition_rows()
    pending = source.submit(0, columns) if sizes else None
    for i, n in enumerate(sizes):
        table = pending.result()
        pending = source.submit(i + 1, columns) if i + 1 < len(sizes) else None  # read while this one is counted
        check_partition(table, rules, partition_name(source, i))
        if visit is not None:
            visit(table)
        if rate < 1.0:
            chosen = np.random.default_rng([seed, i]).random(n) < rate
            table = table.filter(pa.array(chosen))
        parts.append(table)
        if progress is not None:
            progress(n)
    sample = pa.concat_tables(parts).combine_chunks()
    if keep and key is not None and _sample_key(spec, source, rate, seed) == key:  # no file changed meanwhile
        with _kept_lock:
            _kept.clear()
            _kept.update(key=key, table=sample)
    return sample


class RowsRead:
    """How often the whole data reads each row of each packed group, counted partition by partition
    as `sample_rows` reads them (4 bytes a row; groups over MAX_COUNTED_ROWS rows, and groups holding
    managed tables, whose rows only a map gives, are not counted)."""

    def __init__(self, spec: ModelSpec, groups: list[Any]):
        self.spec = spec
        managed = {t.name for t in spec.tables if t.managed is not None}
        self.groups = [g for g in groups if g.rows <= MAX_COUNTED_ROWS and not any(t.table in managed for t in g.tables)]
        self.counts = {g.name: np.zeros(g.rows, dtype=np.uint32) for g in self.groups}

    def visit(self, table: pa.Table) -> None:
        """Count the reads of one partition (its id columns, checked). A group whose fields hold one
        id a sample is counted column by column, chunk by chunk, as the ids are (no packed copy:
        the count does not depend on their order); a group with lists is packed first (a field
        pooled by "none" reads its first max_len ids only)."""
        cols = None
        for g in self.groups:
            counts = self.counts[g.name]
            if not any(_is_list(table.column(f.feature).type) for f in g.fields):
                for f in g.fields:
                    for chunk in table.column(f.feature).chunks:
                        _count_checked(g, counts, chunk.to_numpy(zero_copy_only=False), g.row_offsets[f.table])
                continue
            if cols is None:
                cols = {f.name: column_arrays(table.column(f.name)) for f in self.spec.sparse_features}
            _count_checked(g, counts, pack_group(g, cols, table.num_rows)[0], 0)

    def table_counts(self, group: str, offset: int, rows: int) -> np.ndarray | None:
        """Reads of each row of a group's table (rows offset..offset+rows); None: not counted."""
        counts = self.counts.get(group)
        return None if counts is None else counts[offset:offset + rows]


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _count_checked(group: Any, counts: np.ndarray, ids: np.ndarray, offset: int) -> None:
    bad = _count_into(counts, ids, offset)
    if bad >= 0:  # the partition's checks keep every id in its table: this is a bug, not the data
        raise ValueError(f"packed id {int(ids[bad]) + offset} outside group {group.name}'s {group.rows:,} rows")


@njit(nogil=True, cache=True)
def _count_into(counts, ids, offset):
    """counts[offset + i] += 1 for every id i (uint32, wrapping as numpy's add would); -1, or the
    position of the first id whose row is outside counts (those before it counted). One pass over
    the ids, O(ids) whatever the group's rows: numpy's `bincount` builds a count for every row of
    the group and adds it, a 270 MB pass per partition of DLRM's 33.8 M rows (80-113 ms against
    23-50 ms here for 6.5 M ids, Zipf and uniform)."""
    n = counts.shape[0]
    for k in range(ids.shape[0]):
        i = ids[k] + offset
        if i < 0 or i >= n:
            return k
        counts[i] += 1
    return -1


def count_histogram(counts: np.ndarray) -> list[list[float]]:
    """[[c, rows read c times], ...] of rows read at least once: c exact up to EXACT_COUNTS, then
    geometric bins (ratio COUNT_BIN_RATIO) as [their mean reads, rows].

    Example:
        >>> count_histogram(np.array([0, 1, 1, 3]))
        [[1, 2], [3, 1]]
    """
    counts = np.asarray(counts)
    counts = counts[counts > 0].astype(np.int64)
    if not len(counts):
        return []
    n_c = np.bincount(np.minimum(counts, EXACT_COUNTS + 1), minlength=EXACT_COUNTS + 2)
    out: list[list[float]] = [[c, int(n_c[c])] for c in range(1, EXACT_COUNTS + 1) if n_c[c]]
    big = np.sort(counts[counts > EXACT_COUNTS])
    lo = EXACT_COUNTS + 1
    while len(big):
        hi = max(lo + 1, int(lo * COUNT_BIN_RATIO))
        cut = int(np.searchsorted(big, hi))
        if cut:
            out.append([float(big[:cut].mean()), int(cut)])
        big, lo = big[cut:], hi
    return out


def hot_cdf(counts: np.ndarray) -> list[list[float]]:
    """[[k, share of accesses of the k most accessed rows]] for log-spaced k up to len(counts)."""
    if not len(counts):
        return []
    top = np.cumsum(np.sort(counts)[::-1]) / counts.sum()
    return [[k, float(top[k - 1])] for k in capacities_for(len(counts), CDF_POINTS)]


def good_turing(counts: np.ndarray, rate: float, rows: int | None = None) -> tuple[np.ndarray, float]:
    """(estimated share of all accesses of each counted row, share of the rows never counted).

    `counts`: a Bernoulli sample's accesses per row (rows counted at least once), sampled at `rate`
    from a finite dataset. A row with c accesses in the data shows k ~ Binomial(c, rate) in the
    sample; summing c over the rows counted k times gives, in expectation and in the sample's units,
    ``rate * k * N_k + (1 - rate) * (k + 1) * N_(k+1)`` (N_k: rows counted k times), and
    ``(1 - rate) * N_1`` for the rows never counted: Good-Turing's estimates as rate -> 0, the counts
    themselves at rate 1. Counts above `GT_MAX_COUNT`, or with no row counted once more, keep their
    own count (the adjustment is noise there); the counted rows then share 1 - the unseen share.
    `rows`: the table's rows; a sample that counted every one of them misses nothing.

    Example:
        >>> share, unseen = good_turing(np.array([3, 1, 1, 2]), 0.5)
        >>> round(unseen, 4), round(float(share.sum()) + unseen, 6)
        (0.1429, 1.0)
    """
    counts = np.asarray(counts, dtype=np.int64)
    counts = counts[counts > 0]
    if not len(counts):
        return np.zeros(0), 0.0
    n_k = np.bincount(counts, minlength=GT_MAX_COUNT + 2)
    unseen = _unseen_share(n_k, len(counts), rate, rows)
    adjusted = counts.astype(np.float64)
    for k in range(1, GT_MAX_COUNT + 1):
        if n_k[k] and n_k[k + 1]:
            adjusted[counts == k] = rate * k + (1.0 - rate) * (k + 1) * n_k[k + 1] / n_k[k]
    return adjusted / adjusted.sum() * (1.0 - unseen), float(unseen)


def _unseen_share(n_k: np.ndarray, distinct: int, rate: float, rows: int | None) -> float:
    """(1 - rate) N_1 / N from the rows counted k times (`n_k`); 0 when every row was counted."""
    total = int(np.dot(np.arange(len(n_k)), n_k))
    if not total or (rows is not None and rows <= distinct):
        return 0.0
    return (1.0 - rate) * float(n_k[1]) / total


def hit_cdf(counts: np.ndarray, rate: float, rows: int | None = None) -> list[list[float]]:
    """[[k, estimated share of all accesses of the sample's k most counted rows]] (`hot_cdf`'s k)."""
    counts = np.asarray(counts, dtype=np.int64)
    counts = counts[counts > 0]
    if not len(counts):
        return []
    share, _ = good_turing(counts, rate, rows)
    top = np.cumsum(share[np.argsort(-counts, kind="stable")])
    return [[k, float(top[k - 1])] for k in capacities_for(len(counts), CDF_POINTS)]


def unseen_rows(counts: np.ndarray, rows: int, rate: float, dataset_distinct: int | None = None) -> dict[str, float]:
    """The rows a sample never counted: {"share": of all accesses, "rows": how many of them have any}.

    With `dataset_distinct` (the rows the whole data reads, counted while it is read) the count is
    exact: those rows less the ones the sample counted. Otherwise it is Chao1's lower-bound estimate,
    N_1^2 / (2 N_2) (N_1 (N_1 - 1) / 2 with no row counted twice), at least 1 and at most the table's
    rows not counted; far below the truth on a long tail sampled at a few percent (two_task's
    500,000 synthetic rows at FAE's 5 %: 306,000 estimated, 725,000 read). Both 0 for a sample of
    every row (rate 1) or of a table whose every row it counted.
    """
    counts = np.asarray(counts, dtype=np.int64)
    counts = counts[counts > 0]
    n_k = np.bincount(counts, minlength=3)
    share = _unseen_share(n_k, len(counts), rate, rows)
    if share <= 0:
        return {"share": 0.0, "rows": 0.0}
    if dataset_distinct is not None:
        return {"share": share, "rows": float(max(1, min(int(rows), int(dataset_distinct)) - len(counts)))}
    n1, n2 = int(n_k[1]), int(n_k[2])
    chao1 = n1 * n1 / (2.0 * n2) if n2 else n1 * (n1 - 1) / 2.0
    return {"share": share, "rows": float(min(int(rows) - len(counts), max(1.0, chao1)))}


def skew(counts: np.ndarray, rows: int) -> dict[str, float]:
    """Share of accesses taken by the hottest 0.1% / 1% / 10% of `rows`."""
    top = np.cumsum(np.sort(counts)[::-1]) / max(counts.sum(), 1)
    out = {}
    for frac in SKEW_FRACTIONS:
        k = min(max(int(np.ceil(frac * rows)), 1), len(top))
        out[f"top_{frac * 100:g}%"] = float(top[k - 1]) if len(top) else 0.0
    return out


def profile_access(spec: ModelSpec, source: PartitionSource, sample_rate: float | None = None, seed: int = 0,
                   budget_bytes: int | None = None, window: int | None = None,
                   batch_size: int | None = None, max_trace: int = MAX_TRACE,
                   keep_sample: bool = False, planner_only: bool = False,
                   progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The access profile of a dataset for a spec (see the module docstring). `sample_rate` None:
    FAE's (`flowrec.graph.kinds.hot_sample_rate`), the rows a static hot set is chosen from; with
    the seed FAE is given (the spec's training seed, in training) they are the very same rows.
    `keep_sample`: keep the sampled rows for FAE's hot set (`sample_rows`' `keep`).
    `planner_only`: only what the planner reads (no `budget` or `curves` section, which are for
    people and plots): a run's profile skips simulating five caches at twelve sizes per group,
    seconds of every `flowrec train --data` start (2.2-2.5 s for one group of 100,000 accesses).
    `progress`: called with the rows of each partition as the data is read (`sample_rows`)."""
    if window is not None and not (isinstance(window, int) and 1 <= window <= MAX_WINDOW):
        raise ValueError(f"window must be a whole number of batches in 1..{MAX_WINDOW}, as the spec's plan.window, "
                         f"not {window!r}")
    total = sum(source.partition_rows())
    if sample_rate is None:
        sample_rate = hot_sample_rate(total)
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    groups = group_layout(spec)
    read = RowsRead(spec, groups)
    table = sample_rows(spec, source, sample_rate, seed, read.visit, keep=keep_sample, progress=progress)
    n = table.num_rows
    if n == 0 and total > 0:  # `--sample-rate 1e-300`: a profile of nothing, every table priced from no count
        raise ValueError(f"a sample rate of {sample_rate:g} drew none of the data's {total:,} rows (about "
                         f"{sample_rate * total:.2g} expected): give a rate of at least {min(1.0, 100 / total):.2g} "
                         "(some 100 rows), or leave it out for FAE's rate")
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    cols = fold_raw_ids(spec, cols)  # managed tables: a row per raw id, estimated by hash
    packed = {g.name: pack_group(g, cols, n) for g in groups}
    tables: dict[str, Any] = {}
    every: list[np.ndarray] = []
    for g in groups:
        rows, group_counts = np.unique(packed[g.name][0], return_counts=True)  # one sort of the group's ids
        every.append(group_counts)
        for slot in g.tables:
            lo, hi = np.searchsorted(rows, [slot.row_offset, slot.row_offset + slot.rows])
            counts = group_counts[lo:hi]  # the table's counted rows, by row: as a unique of its own ids
            read_counts = read.table_counts(g.name, slot.row_offset, slot.rows)
            whole = None if read_counts is None else int(np.count_nonzero(read_counts))
            tables[slot.table] = {"rows": slot.rows, "accesses": int(counts.sum()),
                                  "distinct": int(len(counts)), "hot_cdf": hot_cdf(counts),
                                  "hit_cdf": hit_cdf(counts, sample_rate, slot.rows),
                                  "unseen": unseen_rows(counts, slot.rows, sample_rate, whole),
                                  "skew": skew(counts, slot.rows)}
            if read_counts is not None:
                tables[slot.table]["dataset_distinct"] = whole
                tables[slot.table]["dataset_counts"] = count_histogram(read_counts)
    all_counts = np.concatenate(every) if every else np.zeros(0, np.int64)
    profile = {
        "format": PROFILE_FORMAT, "version": 1, "spec": spec.name, "sample_rate": sample_rate,
        "samples": n, "dataset_rows": total, "tables": tables,
        "global": {"accesses": int(all_counts.sum()), "distinct": int(len(all_counts)),
                   "hot_cdf": hot_cdf(all_counts),
                   "skew": skew(all_counts, sum(g.rows for g in groups))},
    }
    bsz = max(1, int(round((batch_size or spec.training.batch_size) * sample_rate)))  # the curves' batch
    if not planner_only:
        _people_sections(profile, spec, groups, packed, n, sample_rate, budget_bytes, window or spec.plan.window,
                         bsz, max_trace)
    profile["warnings"] = sample_warnings(n, total, sample_rate, bsz)
    return profile


def _people_sections(profile: dict[str, Any], spec: ModelSpec, groups, packed, n: int, sample_rate: float,
                     budget_bytes: int | None, w: int, bsz: int, max_trace: int) -> None:
    """The sections for people and plots: the FAE hot set of the budget (`budget`, where there is
    one) and every group's simulated cache curves (`curves`)."""
    budget = budget_bytes if budget_bytes is not None else spec.plan.device_budget_bytes
    if budget is not None:
        profile["budget"] = hot_set(groups, packed, n, budget, sample_rate)
    profile["curves"] = {"window": w, "batch_rows": bsz, "groups": {
        g.name: _curves(packed[g.name], g.bags_per_sample, bsz, w, max_trace) for g in groups}}


def sample_warnings(samples: int, rows: int, sample_rate: float, batch_rows: int) -> list[str]:
    """Why the figures of a small sample mean little (empty when the sample is large enough).

    A sample of every row cannot grow with --sample-rate: then the advice is more data alone.

    >>> sample_warnings(0, 200, 1e-300, 1)[1].split(":")[0]
    'the cache curves simulate 0 sampled batches of 1 row'
    >>> sample_warnings(900, 900, 1.0, 4096)[1].split("; ")[-1]
    'profile more data (the sample holds every row of this dataset already)'
    """
    out = []
    more = "profile more data (the sample holds every row of this dataset already)" if samples >= rows else None
    if samples < MIN_SAMPLE_ROWS:
        out.append(f"the sample holds {samples:,} of {rows:,} rows (sample rate {sample_rate:g}): skew and hot-set "
                   f"figures from fewer than {MIN_SAMPLE_ROWS:,} rows are not reliable; {more or 'raise --sample-rate'}")
    batches = samples // max(batch_rows, 1)
    if batches < MIN_CURVE_BATCHES:
        out.append(f"the cache curves simulate {batches:,} sampled batch{'' if batches == 1 else 'es'} of "
                   f"{batch_rows:,} row{'' if batch_rows == 1 else 's'}: with fewer than "
                   f"{MIN_CURVE_BATCHES} there is little reuse to see, so hit rates near 0 say nothing about "
                   f"training; {more or 'raise --sample-rate or profile more data'}")
    return out


def plotted_tables(profile: dict[str, Any]) -> list[str]:
    """The tables the plot shows and the CLI lists: the PLOTTED_TABLES with the most distinct rows."""
    ranked = sorted(profile["tables"].items(), key=lambda kv: (-kv[1]["distinct"], kv[0]))
    return [name for name, _ in ranked[:PLOTTED_TABLES]]


def hot_set(groups, packed: dict[str, tuple[np.ndarray, np.ndarray]], samples: int,
            budget_bytes: int, sample_rate: float = 1.0, folds: int = HOT_FOLDS) -> dict[str, Any]:
    """FAE hot set: hottest rows by accesses per byte that fit the budget; all-hot sample share.

    The hot rows are chosen on the whole sample. Training applies them to the whole dataset: the
    sampled rows (share `sample_rate`), on which the set was chosen and which are mostly hot
    (`hot_sample_fraction_in_sample`), and the unseen rest, estimated by K-fold cross-validation
    (choose on K-1 folds, score the held-out fold: `hot_sample_fraction_unseen`). The expected
    share of entirely-hot samples is their mix by `sample_rate` (`hot_sample_fraction`).
    """
    if not groups:
        return {"bytes": budget_bytes, "hot_rows": {}, "hot_access_share": 0.0, "hot_sample_fraction": 1.0,
                "hot_sample_fraction_in_sample": 1.0, "hot_sample_fraction_unseen": 1.0}
    sample_of = {g.name: _sample_of(packed[g.name][1], g.bags_per_sample) for g in groups}
    everyone = np.ones(samples, bool)
    hot_rows, share = _hot_rows(groups, packed, sample_of, everyone, budget_bytes)
    fold = np.arange(samples) % max(folds, 2)
    unseen = sum(_all_hot(groups, packed, sample_of,
                          _hot_rows(groups, packed, sample_of, fold != k, budget_bytes)[0], fold == k).sum()
                 for k in range(max(folds, 2))) / max(samples, 1)
    in_sample = float(_all_hot(groups, packed, sample_of, hot_rows, everyone).mean()) if samples else 1.0
    per_group = {g.name: {"rows": int(len(hot_rows[g.name])), "bytes": int(len(hot_rows[g.name]) * g.row_bytes())}
                 for g in groups}
    return {"bytes": budget_bytes, "hot_rows": per_group, "hot_access_share": share,
            "hot_sample_fraction": float(sample_rate * in_sample + (1 - sample_rate) * unseen) if samples else 1.0,
            "hot_sample_fraction_in_sample": in_sample,
            "hot_sample_fraction_unseen": float(unseen) if samples else 1.0}


def _sample_of(offsets: np.ndarray, bags_per_sample: int) -> np.ndarray:
    """The sample of every id.  # (nnz,)"""
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)) // bags_per_sample


def _hot_rows(groups, packed, sample_of, keep: np.ndarray, budget_bytes: int) -> tuple[dict[str, np.ndarray], float]:
    """Hottest rows (accesses per byte) of the samples in `keep` that fit the budget, per group."""
    rows, counts, owner = [], [], []
    for i, g in enumerate(groups):
        r, c = np.unique(packed[g.name][0][keep[sample_of[g.name]]], return_counts=True)
        rows.append(r)
        counts.append(c)
        owner.append(np.full(len(r), i))
    rows_a, counts_a, owner_a = np.concatenate(rows), np.concatenate(counts), np.concatenate(owner)
    row_bytes = np.array([g.row_bytes() for g in groups])[owner_a]
    order = np.lexsort((rows_a, -counts_a / row_bytes))
    hot = np.zeros(len(rows_a), bool)
    hot[order[np.cumsum(row_bytes[order]) <= budget_bytes]] = True
    chosen = {g.name: rows_a[(owner_a == i) & hot] for i, g in enumerate(groups)}
    return chosen, float(counts_a[hot].sum() / max(counts_a.sum(), 1))


def _all_hot(groups, packed, sample_of, hot_rows: dict[str, np.ndarray], score: np.ndarray) -> np.ndarray:
    """Which of the samples in `score` have every id hot.  # (n_scored,) bool"""
    all_hot = np.ones(len(score), bool)
    for g in groups:
        cold = ~np.isin(packed[g.name][0], hot_rows[g.name])
        all_hot[sample_of[g.name][cold]] = False
    return all_hot[score]


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
    shown = plotted_tables(profile)
    for name in shown:
        t = profile["tables"][name]
        if t["hot_cdf"]:
            k, share = zip(*t["hot_cdf"])
            left.plot(k, share, label=name)
    left.set(xscale="log", xlabel="hottest rows k", ylabel="share of sampled accesses (in-sample)",
             title=f"access skew, {len(shown)} tables with the most distinct rows")
    left.legend(fontsize=7)
    groups = profile["curves"]["groups"]
    if groups:
        name, curves = next(iter(groups.items()))
        for policy, rates in curves.items():
            if policy not in ("capacity_rows", "accesses"):
                right.plot(curves["capacity_rows"], rates, marker=".", label=policy)
        budget = profile.get("budget")
        if budget is not None and name in budget["hot_rows"] and budget["hot_rows"][name]["rows"]:
            rows = budget["hot_rows"][name]["rows"]
            right.axvline(rows, color="gray", linestyle="--",
                          label=f"budget {budget['bytes']:,} bytes: {rows:,} hot rows here")
        right.set(xscale="log", xlabel="cache capacity (rows)", ylabel="hit rate (sampled batches)",
                  title=f"hit rate, group {name}")
        right.legend(fontsize=7)
    if profile.get("warnings"):
        fig.suptitle(f"sample of {profile['samples']:,} rows: too small for these curves (see the warnings)",
                     color="firebrick")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
