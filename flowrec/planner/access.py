"""Row-access distributions: how often each row of a table (or packed group) is read.

An `AccessModel` is a list of segments (rows, probability per row), hottest first; the hottest
k rows' share of all accesses (the hit rate of a cache holding them) and the expected number of
distinct rows among n lookups follow directly. Distributions come from an access profile
(``flowrec data profile``: per table ``hot_cdf`` points, linearly interpolated) or, without one,
from a Zipf law with exponent `ZIPF_EXPONENT` — recommendation ids are heavy-tailed; 1.05 is a
typical fit of Criteo/Avazu categorical ids (a few rows take most accesses). Group models merge
their member tables weighted by their access counts (segments sorted by density: the cache holds
the globally hottest rows, as FAE's hot-embedding layout does).

Example:
    >>> m = zipf_model(1000)
    >>> round(m.hit_rate(1000), 6), m.hit_rate(100) > 0.5
    (1.0, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import exp, log
from typing import Any, Iterable, Mapping

ZIPF_EXPONENT = 1.05  # Zipf exponent s: p(rank k) ~ k^-s
EXACT_RANKS = 64  # hottest ranks modelled one row per segment
BIN_RATIO = 1.5  # geometric growth of the rank bins beyond EXACT_RANKS


@dataclass(frozen=True)
class AccessModel:
    """Row-access distribution as (rows, probability per row) segments, hottest first.

    Args:
        segments: probabilities sum to 1 over all rows (sum of rows * p).

    Example:
        >>> AccessModel(((1, 0.5), (2, 0.25))).hit_rate(2)
        0.75
    """

    segments: tuple[tuple[float, float], ...]

    @property
    def rows(self) -> float:
        return sum(r for r, _ in self.segments)

    def hit_rate(self, cache_rows: float) -> float:
        """Share of accesses that hit when the hottest `cache_rows` rows are cached."""
        left, share = float(cache_rows), 0.0
        for rows, p in self.segments:
            take = min(rows, left)
            share += take * p
            left -= take
            if left <= 0:
                break
        return min(1.0, share)

    def distinct(self, draws: float) -> float:
        """Expected distinct rows among `draws` independent lookups (Poisson approximation)."""
        return sum(rows * (1.0 - exp(-draws * p)) for rows, p in self.segments)


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


def cdf_model(rows: int, hot_cdf: Iterable[Iterable[float]]) -> AccessModel:
    """From profile points [k, share of accesses by the hottest k rows], interpolated linearly."""
    points = sorted((float(k), float(s)) for k, s in hot_cdf if 0 < k <= rows)
    if not points or points[-1][0] < rows:
        points.append((float(rows), 1.0))
    segs, prev_k, prev_s = [], 0.0, 0.0
    for k, s in points:
        s = max(s, prev_s)
        if k > prev_k:
            segs.append((k - prev_k, (s - prev_s) / (k - prev_k)))
        prev_k, prev_s = k, s
    total = sum(r * p for r, p in segs) or 1.0
    return AccessModel(tuple(sorted(((r, p / total) for r, p in segs), key=lambda x: -x[1])))


def merge(models: Iterable[tuple[AccessModel, float]]) -> AccessModel:
    """One distribution over the union of tables, each weighted by its share of accesses."""
    pairs = [(m, w) for m, w in models if w > 0]
    total = sum(w for _, w in pairs) or 1.0
    segs = [(r, p * w / total) for m, w in pairs for r, p in m.segments]
    return AccessModel(tuple(sorted(segs, key=lambda x: -x[1])))


def group_model(tables: Iterable[tuple[str, int, float]], profile: Mapping[str, Any] | None) -> tuple[AccessModel, str]:
    """Access model of a packed group and where it came from ("profile", "zipf" or "mixed").

    Args:
        tables: (table, rows, lookups per sample) of the member tables.
        profile: an access profile document or None.

    Weights are the profile's access counts when every member is profiled, else lookups per
    sample (tables missing from the profile follow the Zipf law).
    """
    tables = list(tables)
    known = (profile or {}).get("tables", {})
    hits = [t for t, _, _ in tables if t in known]
    all_profiled = len(hits) == len(tables)
    parts = []
    for table, rows, lookups in tables:
        if table in known:
            entry = known[table]
            model = cdf_model(rows, entry.get("hot_cdf", ()))
            weight = float(entry.get("accesses", 0)) if all_profiled else lookups
        else:
            model, weight = zipf_model(rows), lookups
        parts.append((model, weight))
    source = "profile" if all_profiled else ("mixed" if hits else "zipf")
    return (parts[0][0] if len(parts) == 1 else merge(parts)), source
