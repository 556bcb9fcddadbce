"""Row-access distributions: how often each row of a table (or packed group) is read.

An `AccessModel` is a list of segments (rows, probability per row), hottest first; the hottest
k rows' share of all accesses (the hit rate of a cache holding them) and the expected number of
distinct rows among n lookups follow directly. Distributions come from an access profile
(``flowrec data profile``: per table ``hit_cdf`` points, linearly interpolated, and its ``unseen``
rows, which take the rest of the accesses evenly; profiles written before ``hit_cdf`` existed give
``hot_cdf``, the sample's own shares) or, without one,
from a Zipf law with exponent `ZIPF_EXPONENT` — recommendation ids are heavy-tailed; 1.05 is a
typical fit of Criteo/Avazu categorical ids (a few rows take most accesses). Group models merge
their member tables weighted by their access counts (segments sorted by density: the cache holds
the globally hottest rows, as FAE's hot-embedding layout does).

A static hot set holds only rows FAE's profiling sample counted (`flowrec.graph.kinds.hot_sample_rate`
of the data: a run's planner profiles that very sample; a smaller profile with the same seed is part
of it): `AccessModel.findable` is how many that is expected to be, and `hot_rows` caps a cache at it.
It fills in FAE's order, not the true one (`AccessModel.fill_order`): the rows the sample counted,
most counted first, then the unseen rows FAE's larger sample is expected to find; never a row no
sample counted, however hot the unseen rows are on average.

Example:
    >>> m = zipf_model(1000)
    >>> round(m.hit_rate(1000), 6), m.hit_rate(100) > 0.5
    (1.0, True)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import exp, expm1, log
from typing import Any, Iterable, Mapping

from flowrec.graph.kinds import HORIZON_WINDOWS, hot_sample_rate

ZIPF_EXPONENT = 1.05  # Zipf exponent s: p(rank k) ~ k^-s
EXACT_RANKS = 64  # hottest ranks modelled one row per segment
BIN_RATIO = 1.5  # geometric growth of the rank bins beyond EXACT_RANKS
BEYOND_HORIZON_SAVED = 0.5  # of the fetches a scratchpad's slots past its horizon would save if it
# ranked rows by their reads in the epoch (it ranks by reads since their fetch). Fitted on the
# runtime's policy over synthetic epochs: 0 (the horizon only) priced +2 % to +16 %, 1 -4 % to -10 %
# (two_task, din_taobao, tests/unit/test_access_epoch.py's data); see Round 23 in
# docs/benchmarks/costmodel-rounds-4-25.md


@dataclass(frozen=True)
class AccessModel:
    """Row-access distribution as (rows, probability per row) segments, hottest first.

    Args:
        segments: probabilities sum to 1 over all rows (sum of rows * p).
        findable: rows a static hot set can hold (those FAE's profiling sample counts); None: any.
        hot_order: the same rows as (rows, p, tier) in the order a static hot set fills them
            (`fill_order`); None: `segments`' order, the first `findable` rows counted.
        epoch: how often one pass over the data reads each row (`EpochCounts`), when the profile
            counted it; distinct rows and the lookahead cache's fetches then come from it.

    Example:
        >>> AccessModel(((1, 0.5), (2, 0.25))).hit_rate(2)
        0.75
        >>> AccessModel(((1, 0.5), (2, 0.25)), findable=1.0).hot_rows(2)
        1.0
    """

    segments: tuple[tuple[float, float], ...]
    findable: float | None = None
    hot_order: tuple[tuple[float, float, int], ...] | None = None
    epoch: EpochCounts | None = None

    @property
    def rows(self) -> float:
        return sum(r for r, _ in self.segments)

    def hit_rate(self, cache_rows: float) -> float:
        """Share of accesses that hit when the hottest `cache_rows` rows are cached."""
        return _filled_share(self.segments, cache_rows)

    def hot_rows(self, cache_rows: float) -> float:
        """Rows a static hot set of `cache_rows` slots holds: no more than its sample can find."""
        return float(cache_rows) if self.findable is None else min(float(cache_rows), self.findable)

    def fill_order(self) -> tuple[tuple[float, float, int], ...]:
        """(rows, p, tier) segments in the order a static hot set fills its slots.

        Tier 0: rows the profile's sample counted, hottest first; 1: unseen rows FAE's larger sample
        is expected to count; 2: rows no sample counts, never in the hot set. FAE ranks rows by its
        own counts, and a row it counts once ranks below the rows the (nested) planner's sample
        already counted, so tiers, not the true probabilities, order the fill.
        """
        if self.hot_order is not None:
            return self.hot_order
        if self.findable is None:
            return tuple((r, p, 0) for r, p in self.segments)
        return _tiered(self.segments, self.findable)

    def hot_set_hit_rate(self, cache_rows: float) -> float:
        """Share of accesses that hit a static hot set of `cache_rows` slots (`hot_rows` of them filled,
        in `fill_order`)."""
        return _filled_share(((rows, p) for rows, p, _ in self.fill_order()), self.hot_rows(cache_rows))

    def distinct(self, draws: float) -> float:
        """Expected distinct rows among `draws` lookups: of an epoch's reads (`EpochCounts`) when
        known, else of independent lookups (Poisson approximation)."""
        if self.epoch is not None:
            return self.epoch.distinct(draws)
        return sum(rows * (1.0 - exp(-draws * p)) for rows, p in self.segments)

    def window_fetches(self, draws: float, window: int, capacity: float = 0.0, epochs: float = 1.0) -> float:
        """Rows a lookahead scratchpad of `capacity` slots fetches per batch of `draws` lookups,
        pinning the rows of `window` batches (see `retained_fetches`); 0 slots: the window only.
        `epochs`: the run's passes over the data, when an epoch's reads are counted
        (`EpochCounts.fetches`; a stream of independent lookups has no epochs)."""
        return self.window_traffic(draws, window, capacity, epochs)[0]

    def window_traffic(self, draws: float, window: int, capacity: float = 0.0,
                       epochs: float = 1.0) -> tuple[float, float]:
        """(rows fetched, rows written back) per batch in the run's steps (`window_fetches`): with
        an epoch's reads counted, the write-backs less the rows still resident as the run ends
        (`EpochCounts.traffic`); a stream without epochs writes back every fetch."""
        if self.epoch is not None:
            return self.epoch.traffic(draws, window, capacity, epochs)
        rates = [(rows, draws * p) for rows, p in self.segments]
        fetched = retained_fetches(lambda t: _stream_terms(rates, window, t), window, capacity)
        return fetched, fetched


@dataclass(frozen=True)
class EpochCounts:
    """How often one pass over the data (an epoch) reads each row: (reads c, rows read c times).

    A shuffled epoch spreads a row's c reads over its batches at random, so its distinct rows among
    a share f of the epoch's reads are sum rows * (1 - (1 - f)^c), exactly in expectation for
    whole batches drawn without replacement; the lookahead cache's fetches follow from the gaps
    between a row's reads (`fetches`). Rows read once are fetched once an epoch whatever the cache
    holds: on a long tail (two_task's synthetic data: 563,502 of 810,185 rows read once) they, not
    the window, decide the traffic.

    Example:
        >>> e = EpochCounts(((1.0, 100.0), (10.0, 10.0)))
        >>> e.reads, round(e.distinct(100.0), 3)  # half the epoch: half the once-read rows, most of the rest
        (200.0, 59.99)
    """

    counts: tuple[tuple[float, float], ...]

    @property
    def reads(self) -> float:
        return sum(c * rows for c, rows in self.counts)

    def distinct(self, draws: float) -> float:
        f = min(1.0, max(0.0, draws / (self.reads or 1.0)))
        return sum(rows * (1.0 - (1.0 - f) ** c) for c, rows in self.counts)

    @property
    def rows(self) -> float:
        """Rows the epoch reads at least once."""
        return sum(rows for _, rows in self.counts)

    def batches(self, draws: float) -> float:
        """Batches of `draws` reads in the epoch (at least 1)."""
        return max(1.0, self.reads / max(draws, 1e-9))

    def traffic(self, draws: float, window: int, capacity: float, epochs: float = 1.0) -> tuple[float, float]:
        """(`fetches`, rows written back) per batch in the run's steps: every row fetched, once
        evicted, less those resident as the run ends (the slots full, or every row the data
        reads): avazu's 23-batch epoch with the plan's 66,894 slots held 70% of its rows at the
        end, whose write-back priced a one-epoch run's bytes 11% high (round 38)."""
        fetched = self.fetches(draws, window, capacity, epochs)
        resident = min(float(capacity), self.rows) / (self.batches(draws) * max(1.0, float(epochs)))
        return fetched, max(0.0, fetched - resident)

    def fetches(self, draws: float, window: int, capacity: float, epochs: float = 1.0) -> float:
        """Rows fetched per batch of `draws` reads, averaged over a run of `epochs` epochs
        (`retained_fetches`): each row's first read of an epoch, then every gap between reads
        longer than the cache keeps it.

        With its c reads at random among the epoch's E batches, a gap between two of them exceeds s
        batches with probability (1 - s/E)^c; the row is pinned while a read is in the window, and
        kept between two reads when the gap is at most the threshold T.

        The scratchpad keeps its rows from one epoch to the next, so a row's first read of a later
        epoch is a hit when the row was resident as the epoch before ended and stays until that
        read (`_boundary_hits`); a cache that holds every row the data reads never evicts one, and
        fetches each once in the run."""
        batches, every = self.batches(draws), self.rows
        least = every / (batches * max(1.0, float(epochs)))  # each row is fetched at least once in the run
        if capacity >= every:  # nothing is ever evicted
            return least
        later = 1.0 - 1.0 / max(1.0, float(epochs))  # the share of the run's epochs that follow another
        terms = lambda t: _epoch_terms(self.counts, batches, window, t)  # noqa: E731
        fetched, spare, threshold = _retained(terms, window, capacity, top=batches)
        if later > 0:
            fetched -= later * _boundary_hits(self.counts, batches, window, capacity, threshold) / batches
        if spare <= 0:
            return max(fetched, least)
        # Slots left once every gap the horizon sees is kept hold rows by reads since their fetch
        # (`NextUseFirst` beyond the horizon): the most read rows stay, over their longer gaps and
        # after their last read alike. Were the ranking by each row's reads in the epoch, a row
        # read c times would be held (its share of the epoch) ((c - 1) y^(c+1) + 1) / (c + 1)
        # beyond what the horizon keeps, y = 1 - horizon/E, and save the fetches of its gaps over
        # the horizon, (c - 1) y^c an epoch. Reads since the fetch are a partial count, so only
        # BEYOND_HORIZON_SAVED of that is priced.
        y, saved = 1.0 - _horizon(window) / batches, 0.0
        for c, rows in sorted(self.counts, reverse=True):
            if c <= 1 or spare <= 0:
                break
            held = ((c - 1.0) * y ** (c + 1.0) + 1.0) / (c + 1.0)
            take = min(rows, spare / held)
            saved += take * (c - 1.0) * y ** c / batches
            spare -= take * held
        return max(fetched - BEYOND_HORIZON_SAVED * saved, least)


def retained_fetches(terms: Any, window: int, capacity: float, top: float | None = None) -> float:
    """Rows fetched per batch by a lookahead scratchpad of `capacity` slots (W = `window`).

    The scratchpad pins the rows of the next W batches and, with slots to spare, keeps rows between
    their reads: its victims are rows no batch of the horizon uses, then the horizon's by furthest
    next use (`flowrec.runtime.caches.victims.NextUseFirst`), as Belady's rule does. Such a cache
    keeps a row over every gap between two reads of at most T batches and drops it over longer
    ones, T set so that the pinned rows and the kept ones fill the slots. It knows the next read
    only within the horizon (W + H batches, H = `HORIZON_WINDOWS` windows), so T is at most W + H:
    beyond it the victims go by reads since the fetch, and a row read once ranks with one read
    twice; slots spent so are not priced as kept (two_task's synthetic epoch: the runtime's policy
    fetched 7,254 rows a batch; priced 7,815 with T at most W + H, 6,637 without the bound).
    `terms(T)` gives (slots taken, rows fetched) per batch at threshold T; T = W (no slot to spare,
    or a capacity of 0) is the window alone: a row is fetched when its next read is more than W
    batches after the last.
    """
    return _retained(terms, window, capacity, top)[0]


def _boundary_hits(counts: Iterable[tuple[float, float]], batches: float, window: int, capacity: float,
                   threshold: float) -> float:
    """Rows whose first read of an epoch hits a scratchpad of `capacity` slots that kept its rows
    from the epoch before (an epoch of `batches`; rows read c times an epoch, `counts`).

    As an epoch ends its pipeline sees no further read of a row (the next epoch's order is drawn
    when its pipeline opens), so the scratchpad holds the window's rows (pinned: a read in the
    last W batches) and, in its other slots, the rows read most since their fetch, the most
    recently read first among equals (`NextUseFirst`): rows read c times an epoch by c, then by
    the end gap. The new epoch's pipeline then shows their reads, and a held row stays until its
    first one when that comes within the epoch's threshold T (rows further out are the victims
    first, as within an epoch): P(v <= T) = 1 - (1 - T/E)^c. But the new epoch's first window
    pins its rows at once, before any row of the epoch is done with: each it misses takes the
    slot of a held row, the furthest read first, which then misses too, unless rows read beyond
    the pipeline's horizon (W + 3W batches) are there to go first. On avazu's 23-batch epoch with
    the plan's 66,894 slots (96k rows): 39.3k of the second epoch's first reads missed, 29.1k
    without that displacement, 39.1k with it (round 38, `tools/bench_lookahead_fetches.py`).

    Example:
        >>> round(_boundary_hits([(1.0, 100.0)], 10.0, 2, 100.0, 10.0), 6)  # all held, all within T
        100.0
    """
    levels = sorted(counts, key=lambda x: -x[0])
    pinned = [1.0 - max(0.0, 1.0 - window / batches) ** c for c, _ in levels]
    left = capacity - sum(rows * p for (_, rows), p in zip(levels, pinned))
    within = min(1.0, max(0.0, threshold / batches))
    seen = max(0.0, 1.0 - _horizon(window) / batches)  # a read past the new pipeline's horizon: (1 - H/E)^c
    hits = first = missed = beyond = 0.0
    for (c, rows), p in zip(levels, pinned):  # p: a read among W batches, the last or the first ones
        kept = min(rows * (1.0 - p), max(0.0, left))
        left -= kept
        held = rows * p + kept  # resident as the epoch ends
        hits += held * (1.0 - (1.0 - within) ** c)
        first += held * p  # held, and first read among the new epoch's first W batches
        missed += (rows - held) * p
        beyond += held * seen ** c
    return hits - min(max(0.0, missed - beyond), max(0.0, hits - first))


def _horizon(window: int) -> float:
    """The batches a lookahead scratchpad knows the next reads of: the window and its horizon."""
    return float(window) * (1 + HORIZON_WINDOWS)


def _retained(terms: Any, window: int, capacity: float, top: float | None = None) -> tuple[float, float, float]:
    """(`retained_fetches`, slots still spare with every gap up to the horizon kept: 0 when T
    stops short of it, or when `top`, an epoch's batches, is no further; the threshold T)."""
    held, fetched = terms(float(window))
    if capacity <= held:
        return fetched, 0.0, float(window)
    hi = _horizon(window) if top is None else min(float(top), _horizon(window))
    held, fetched = terms(hi)
    if held <= capacity:
        short_of_top = top is None or hi < top  # gaps past the horizon exist
        return fetched, capacity - held if short_of_top else 0.0, hi
    lo = float(window)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if terms(mid)[0] > capacity:
            hi = mid
        else:
            lo = mid
    return terms(lo)[1], 0.0, lo


def _epoch_terms(counts: Iterable[tuple[float, float]], batches: float, window: int, t: float) -> tuple[float, float]:
    """(slots, fetches) per batch at threshold t for rows read c times in an epoch of `batches`."""
    w, y = max(0.0, 1.0 - window / batches), max(0.0, 1.0 - t / batches)
    held = fetched = 0.0
    for c, rows in counts:
        held += rows * (1.0 - w ** c)  # pinned: a read among the window's batches
        if t > window and c > 1:  # kept over the gaps of W..t batches, (gap - W) batches each
            gap = batches / (c + 1.0) * (w ** (c + 1.0) - y ** (c + 1.0)) - (t - window) * y ** c
            held += rows * (c - 1.0) * max(0.0, gap) / batches
        fetched += rows * (1.0 + (c - 1.0) * y ** c) / batches  # the first read, then each gap over t
    return held, fetched


def _stream_terms(rates: Iterable[tuple[float, float]], window: int, t: float) -> tuple[float, float]:
    """(slots, fetches) per batch at threshold t for rows read at `a` per batch (Poisson, no epoch)."""
    held = fetched = 0.0
    for rows, a in rates:
        held += rows * -expm1(-a * window)
        if t > window:
            held += rows * (exp(-a * window) - exp(-a * t) - a * (t - window) * exp(-a * t))
        fetched += rows * -expm1(-a) * exp(-a * t)
    return held, fetched


def _filled_share(segments: Iterable[tuple[float, float]], rows: float) -> float:
    """Share of accesses of the first `rows` rows of `segments`, in their order."""
    left, share = float(rows), 0.0
    for count, p in segments:
        if left <= 0:
            break
        take = min(count, left)
        share += take * p
        left -= take
    return min(1.0, share)


def _tiered(segments: Iterable[tuple[float, float]], counted: float) -> tuple[tuple[float, float, int], ...]:
    """`segments` (hottest first) as fill-order segments: the first `counted` rows tier 0, the rest 2."""
    first, rest, left = [], [], float(counted)
    for rows, p in segments:
        take = min(rows, max(left, 0.0))
        if take > 0:
            first.append((take, p, 0))
        if rows - take > 0:
            rest.append((rows - take, p, 2))
        left -= take
    return tuple(first + rest)


def _by_fill(segments: Iterable[tuple[float, float, int]]) -> tuple[tuple[float, float, int], ...]:
    return tuple(sorted(segments, key=lambda x: (x[2], -x[1])))


def zipf_model(rows: int, exponent: float = ZIPF_EXPONENT) -> AccessModel:
    """Zipf(exponent) over `rows` rows: exact for the hottest ranks, geometric bins beyond."""
    segs: list[tuple[float, float]] = [(1.0, k ** -exponent) for k in range(1, min(rows, EXACT_RANKS) + 1)]
    lo = EXACT_RANKS + 1
    while lo <= rows:
        hi = min(rows, max(lo, int(lo * BIN_RATIO)))
        width = hi - lo + 1
        mass = _power_integral(lo - 0.5, hi + 0.5, exponent)
        segs.append((float(width), mass / width))
        lo = hi + 1
    total = sum(r * p for r, p in segs)
    return AccessModel(tuple((r, p / total) for r, p in segs))


def _power_integral(a: float, b: float, s: float) -> float:
    """Integral of x^-s over [a, b]."""
    if abs(s - 1.0) < 1e-9:
        return log(b / a)
    return (b ** (1 - s) - a ** (1 - s)) / (1 - s)


def cdf_model(rows: int, hot_cdf: Iterable[Iterable[float]], unseen: Mapping[str, float] | None = None,
              findable: float | None = None) -> AccessModel:
    """From profile points [k, share of accesses by the hottest k rows], interpolated linearly;
    `unseen` ({"share", "rows"}): rows the points do not cover, taking `share` of the accesses
    evenly (the points then end at 1 - share); every other row is never read. With `findable`
    the static hot set's fill order (`AccessModel.fill_order`) is the counted rows, then
    `findable` - counted of the unseen ones."""
    points = sorted((float(k), float(s)) for k, s in hot_cdf if 0 < k <= rows)
    share = float((unseen or {}).get("share", 0.0))
    extra = float((unseen or {}).get("rows", 0.0))
    counted = points[-1][0] if points else 0.0
    extra = max(0.0, min(extra, rows - counted))
    if share <= 0 or extra < 1 or share >= 1:
        share, extra = 0.0, 0.0
    tagged, prev_k, prev_s = [], 0.0, 0.0  # (rows, p, tier): rows past the sample's counted ones tier 2
    if not points or (not extra and points[-1][0] < rows):
        points.append((float(rows), 1.0))
    for k, s in points:
        s = max(s, prev_s)
        if k > prev_k:
            tagged.append((k - prev_k, (s - prev_s) / (k - prev_k), 0 if k <= counted else 2))
        prev_k, prev_s = k, s
    total = sum(r * p for r, p, _ in tagged) or 1.0
    tagged = [(r, p / total * (1.0 - share), t) for r, p, t in tagged]
    if extra:
        found = 0.0 if findable is None else max(0.0, min(extra, float(findable) - counted))
        tagged += [(found, share / extra, 1), (extra - found, share / extra, 2),
                   (max(0.0, rows - prev_k - extra), 0.0, 2)]
    tagged = [x for x in tagged if x[0] > 0]
    segs = [(r, p) for r, p, _ in tagged]
    hot_order = None if findable is None else _by_fill(tagged)
    return AccessModel(tuple(sorted(segs, key=lambda x: -x[1])), findable, hot_order)


def merge(models: Iterable[tuple[AccessModel, float]]) -> AccessModel:
    """One distribution over the union of tables, each weighted by its share of accesses."""
    pairs = [(m, w) for m, w in models if w > 0]
    total = sum(w for _, w in pairs) or 1.0
    segs = [(r, p * w / total) for m, w in pairs for r, p in m.segments]
    findable = None if all(m.findable is None for m, _ in pairs) else \
        sum(m.rows if m.findable is None else m.findable for m, _ in pairs)
    order = None if findable is None else \
        _by_fill((r, p * w / total, t) for m, w in pairs for r, p, t in m.fill_order())
    return AccessModel(tuple(sorted(segs, key=lambda x: -x[1])), findable, order)


def group_model(tables: Iterable[tuple[str, int, float]], profile: Mapping[str, Any] | None) -> tuple[AccessModel, str]:
    """Access model of a packed group and where it came from ("profile", "zipf" or "mixed").

    Args:
        tables: (table, rows, lookups per sample) of the member tables.
        profile: an access profile document or None.

    Weights are the profile's access counts when every member is profiled, else lookups per
    sample (tables missing from the profile follow the Zipf law). A profiled table's `findable`
    rows (`AccessModel`) are the rows its sample counted plus the unseen rows FAE's larger sample
    of the same data is expected to meet (`findable_rows`).
    """
    tables = list(tables)
    known = (profile or {}).get("tables", {})
    hits = [t for t, _, _ in tables if t in known]
    all_profiled = len(hits) == len(tables)
    parts = []
    for table, rows, lookups in tables:
        if table in known:
            entry = known[table]
            if "hit_cdf" in entry:
                model = cdf_model(rows, entry["hit_cdf"], entry.get("unseen"),
                                  findable_rows(entry, profile or {}))
            else:  # a profile from before hit_cdf: the sample's own shares
                model = cdf_model(rows, entry.get("hot_cdf", ()))
            weight = float(entry.get("accesses", 0)) if all_profiled else lookups
        else:
            model, weight = zipf_model(rows), lookups
        parts.append((model, weight))
    source = "profile" if all_profiled else ("mixed" if hits else "zipf")
    model = parts[0][0] if len(parts) == 1 else merge(parts)
    if epoch_counted((t for t, _, _ in tables), profile):  # every member's reads counted: the epoch's own
        model = replace(model, epoch=EpochCounts(tuple((float(c), float(r)) for t, _, _ in tables
                                                       for c, r in known[t]["dataset_counts"])))
    return model, source


def epoch_counted(tables: Iterable[str], profile: Mapping[str, Any] | None) -> bool:
    """Whether `profile` counts an epoch's reads of every one of `tables` (`dataset_counts`): the
    access model of a group of them then has `AccessModel.epoch` (`group_model`)."""
    known = (profile or {}).get("tables", {})
    names = list(tables)
    return bool(names) and all(known.get(t, {}).get("dataset_counts") is not None for t in names)


def dataset_rows(profile: Mapping[str, Any] | None) -> int | None:
    """Rows of the profiled dataset: the profile's `dataset_rows`, else (profiles written before
    it) sampled rows / sample rate, a Bernoulli estimate; None when the profile says neither."""
    if not profile:
        return None
    if profile.get("dataset_rows"):
        return int(profile["dataset_rows"])
    if not profile.get("samples") or not profile.get("sample_rate"):
        return None
    return int(round(float(profile["samples"]) / float(profile["sample_rate"])))


def findable_rows(entry: Mapping[str, Any], profile: Mapping[str, Any]) -> float:
    """Rows of a profiled table FAE's profiling sample is expected to count.

    FAE counts `hot_sample_rate` of the dataset (`dataset_rows`: its rows, or before profiles
    recorded them, samples / sample rate); with the same seed the planner's sample is part of it,
    and a run's is all of it. Beyond the profile's distinct rows, its extra accesses meet the unseen
    rows (``unseen``: share u of accesses over U rows) and find ``U * (1 - exp(-extra * u / U))`` of
    them.
    """
    distinct = float(entry.get("distinct", 0))
    unseen = entry.get("unseen") or {}
    share, count = float(unseen.get("share", 0.0)), float(unseen.get("rows", 0.0))
    rate = float(profile.get("sample_rate", 1.0) or 1.0)
    samples = float(profile.get("samples", 0))
    if share <= 0 or count < 1 or samples <= 0:
        return distinct
    fae_rate = hot_sample_rate(dataset_rows(profile) or 1)
    extra = float(entry.get("accesses", 0)) * max(0.0, fae_rate / rate - 1.0)
    return distinct + count * (1.0 - exp(-extra * share / count))
