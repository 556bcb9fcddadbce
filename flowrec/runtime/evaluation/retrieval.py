"""Exact retrieval metrics over the full item catalogue, streaming over batches of (user, item) rows.

Each evaluation row is a query (its query-tower vector) and its positive item. The positive's
rank is the number of catalogue items (the rows 1 .. vocab a raw id was fitted to, as serving
recommends) scoring at least as high, other than itself (ties count against it; an item outside
the catalogue, e.g. unknown, ranks last). With the
rows grouped by a user feature (`training.eval_group_by`), a user's test items are the positives
of their rows (a query depends on the user's features only):

- ``hr@K``: share of rows whose item ranks in the top K (TF Recommenders' top-K accuracy);
- ``recall@K``: per user, share of their distinct test items in the top K; mean over users;
- ``ndcg@K``: per user, sum of 1 / log2(rank + 2) over their distinct items in the top K, over
  the best possible sum for their number of distinct items (at most K); mean over users;
- ``mrr``: mean of 1 / (rank + 1) over rows (0 for an item outside the catalogue).

A user's test items are a set: an item in several of their rows counts once (at its best rank).
Rows whose item is outside the catalogue all hold row 0 (an unknown item) or a row no raw id was
fitted to, whichever raw items they had, so each such row counts as a distinct item of its user.
One place of a top-K list holds one item: in rank order, a user's j-th item (from 0) takes place
max(rank, j). With a query that depends on the user alone this changes nothing (j items already
score at least as high); with per-row queries (rows grouped by a column the query does not depend
on alone) it keeps recall@K and ndcg@K in [0, 1]. An item outside the catalogue is in no top K.

Without grouping every row is its own user (recall@K = hr@K). Scores are computed in chunks of
the catalogue, so memory is (batch, chunk) whatever the catalogue's size. With `seen` (a head's
`exclude_seen`), the items a row's user has in the training data are left out of its ranking (they
neither count above the positive nor, being absent, take a place of the top K); the positive
itself always stays.

Example:
    >>> acc = RankingAccumulator(torch.eye(3), "dot", 1.0, (1,))
    >>> acc.update(np.array([1, 2]), np.array([[1.0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]]))
    >>> acc.result()["hr@1"]
    0.5
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from flowrec.runtime.retrieval import read_items
from flowrec.spec.tasks import RANK_METRICS
from operators.retrieval import UnitRows, pair_scores, towers

SCORE_CHUNK = 65_536  # catalogue items scored per matrix product


class RankingAccumulator:
    """Feed (item ids (B,), head outputs [query | item] (B, 2D), groups (B,) or None) per batch.

    Args:
        catalogue: item-tower vectors of table rows 1 .. V, row r - 1 for row r.  # (V, D)
        metric: dot or cosine.
        temperature: the similarity's temperature (ranks do not depend on it; kept for scores).
        top_k: the cut-offs K.
        seen: each user's training items, left out of their ranking (exclude_seen).
        named: the table rows that hold an item (a raw id was fitted to them), the catalogue that
            is ranked (a positive on another row ranks last); None: every row 1 .. V.  # (n,) int64
    """

    def __init__(self, catalogue: torch.Tensor, metric: str, temperature: float, top_k: Sequence[int],
                 seen: "SeenItems | None" = None, named: np.ndarray | None = None) -> None:
        # the catalogue's items: the rows `named` holds (those with a raw id), renumbered 1 .. n
        self.renumber = None
        if named is not None:
            named = np.asarray(named, np.int64)
            self.renumber = np.zeros(len(catalogue) + 1, np.int64)  # table row -> item (0: none)
            self.renumber[named] = np.arange(1, len(named) + 1)
            catalogue = catalogue[torch.as_tensor(named - 1, device=catalogue.device)]
        self.catalogue, self.metric, self.temperature = catalogue, metric, float(temperature)
        self.units = UnitRows()  # cosine: the catalogue normalised once, not per batch
        self.seen = seen
        self.top_k = tuple(top_k)
        self.ranks: list[np.ndarray] = []
        self.groups: list[np.ndarray] = []
        self.items: list[np.ndarray] = []
        self.rows = 0  # rows ranked so far (a row's own group when there is no group column)

    def update(self, items: np.ndarray, outputs: np.ndarray, groups: np.ndarray | None = None) -> None:
        items = self._items(np.asarray(items).reshape(-1).astype(np.int64))
        if items.size == 0:
            return
        query, _ = towers(torch.as_tensor(np.asarray(outputs), dtype=self.catalogue.dtype,
                                          device=self.catalogue.device).reshape(items.size, -1))
        excluded = self.seen.mask(np.asarray(groups).reshape(-1), len(self.catalogue), self._items) \
            if self.seen is not None and groups is not None else None
        cosine = self.metric == "cosine"
        catalogue = self.units(self.catalogue) if cosine else self.catalogue
        self.ranks.append(rank_items(query, torch.as_tensor(items), catalogue, self.metric, self.temperature,
                                     excluded, unit_catalogue=cosine))
        self.groups.append(np.asarray(groups).reshape(-1) if groups is not None
                           else np.arange(items.size) + self.rows)
        self.items.append(items)
        self.rows += items.size

    def _items(self, rows: np.ndarray) -> np.ndarray:
        """Table rows as catalogue items (a row without an item: 0, outside the catalogue).  # (N,)"""
        if self.renumber is None:
            return rows
        inside = (rows >= 1) & (rows < len(self.renumber))
        return np.where(inside, self.renumber[np.where(inside, rows, 0)], 0)

    def result(self) -> dict[str, float]:
        ranks = np.concatenate(self.ranks) if self.ranks else np.zeros(0, np.int64)
        groups = np.concatenate(self.groups) if self.groups else np.zeros(0, np.int64)
        items = np.concatenate(self.items) if self.items else np.zeros(0, np.int64)
        return ranking_metrics(ranks, groups, len(self.catalogue), self.top_k, items)


@torch.no_grad()
def rank_items(query: torch.Tensor, items: torch.Tensor, catalogue: torch.Tensor, metric: str,
               temperature: float, excluded: torch.Tensor | None = None, unit_catalogue: bool = False) -> np.ndarray:
    """Each positive's rank among the catalogue (items outside 1 .. V: V).  # (B,) int64

    Ranks are computed in chunks of the catalogue; when the catalogue fits one chunk (the usual
    case) the product is computed once. `unit_catalogue`: its rows are already unit length
    (cosine; `UnitRows`)."""
    size = len(catalogue)
    inside = (items >= 1) & (items <= size)
    column = (items.clamp(1, max(size, 1)) - 1).to(query.device)  # (B,)
    pos = torch.empty(len(items), 1, dtype=query.dtype, device=query.device)  # (B, 1)
    chunks = range(0, size, SCORE_CHUNK)
    cache = {}
    for lo in chunks:  # the positive's score from the very product it is ranked in
        scores = pair_scores(query, catalogue[lo:lo + SCORE_CHUNK], metric, temperature, unit_catalogue)  # (B, chunk)
        if len(chunks) == 1:
            cache[lo] = scores
        here = (column >= lo) & (column < lo + scores.shape[1])
        pos[here, 0] = scores[here, column[here] - lo]
    above = torch.zeros(len(items), dtype=torch.int64, device=query.device)
    if excluded is not None:  # (B, V) bool: never the positive itself
        excluded = excluded.to(query.device).clone()
        excluded[torch.arange(len(items), device=query.device)[inside], column[inside]] = False
    for lo in chunks:
        scores = cache[lo] if lo in cache else pair_scores(query, catalogue[lo:lo + SCORE_CHUNK], metric,
                                                           temperature, unit_catalogue)
        higher = scores >= pos
        if excluded is not None:
            higher &= ~excluded[:, lo:lo + scores.shape[1]]
        above += higher.sum(dim=1)
    ranks = (above - 1).clamp_min(0).cpu()  # the positive itself scores >= itself
    return torch.where(inside, ranks, torch.full_like(ranks, size)).numpy()


class SeenItems:
    """The items each user has in the training data (a user feature's and the item feature's
    columns), as sorted pairs.

    Args:
        users: user id of each pair.  # (P,) int64
        items: item id (table row) of each pair.  # (P,) int64
    """

    def __init__(self, users: np.ndarray, items: np.ndarray) -> None:
        pairs = np.unique(np.stack([np.asarray(users, np.int64), np.asarray(items, np.int64)], 1), axis=0)
        self.users, self.items = pairs[:, 0], pairs[:, 1]

    def through(self, rows: Any) -> "SeenItems":
        """The pairs with each user as `rows` maps it (a managed table's raw id -> its row; a
        negative row, none: the user's pairs are left out)."""
        users = np.asarray(rows(self.users), np.int64)
        keep = users >= 0
        return SeenItems(users[keep], self.items[keep])

    @classmethod
    def of(cls, source: Any, user: str, item: str) -> "SeenItems":
        """The pairs of every partition of a training source."""
        return cls.from_pairs(read_items(source, item, user)[1])

    @classmethod
    def from_pairs(cls, pairs: np.ndarray) -> "SeenItems":
        """From (user, item) pairs, e.g. `read_items`' (read in the pass that counts the items).  # (P, 2)"""
        return cls(pairs[:, 0], pairs[:, 1])

    def mask(self, users: np.ndarray, catalogue: int, items: Any = None) -> torch.Tensor:
        """Per row, the catalogue items (items 1 .. V at columns 0 .. V-1) its user has seen
        (`items`: table rows -> catalogue items, when they differ).  # (B, V) bool"""
        out = torch.zeros(len(users), catalogue, dtype=torch.bool)
        lo = np.searchsorted(self.users, users, side="left")
        hi = np.searchsorted(self.users, users, side="right")
        counts = hi - lo
        rows = np.repeat(np.arange(len(users)), counts)
        starts = np.cumsum(counts) - counts  # where each row's pairs start among the picks
        picks = np.arange(int(counts.sum())) + np.repeat(lo - starts, counts)  # lo .. hi - 1 per row
        cols = (self.items[picks] if items is None else items(self.items[picks])) - 1
        keep = (cols >= 0) & (cols < catalogue)
        out[torch.from_numpy(rows[keep]), torch.from_numpy(cols[keep])] = True
        return out


def ranking_metrics(ranks: np.ndarray, groups: np.ndarray, catalogue: int, top_k: Sequence[int],
                    items: np.ndarray | None = None) -> dict[str, float]:
    """hr@K, recall@K, ndcg@K and mrr from each row's rank, user and item (module docstring).

    Without `items` every row's item is distinct from the other rows' of its user."""
    out: dict[str, float] = {}
    if ranks.size == 0:
        return {**{f"{m}@{k}": float("nan") for k in top_k for m in RANK_METRICS}, "mrr": float("nan")}
    ranks = np.asarray(ranks, np.int64).reshape(-1)
    _, user = np.unique(groups, return_inverse=True)
    user = user.reshape(-1)
    item = np.arange(ranks.size) if items is None else np.asarray(items, np.int64).reshape(-1)
    outside = ranks >= catalogue  # e.g. unknown: every such row is item 0, whichever raw item it held,
    item = np.where(outside, -1 - np.arange(ranks.size), item)  # so each counts as an item of its own
    # a user's distinct items, each at its best rank, in (user, rank) order
    order = np.lexsort((ranks, item, user))
    first = np.ones(order.size, bool)
    first[1:] = (user[order][1:] != user[order][:-1]) | (item[order][1:] != item[order][:-1])
    pick = order[first]  # the best-ranked row of each (user, item)
    d_user, d_rank = user[pick], ranks[pick]
    by_rank = np.lexsort((d_rank, d_user))
    d_user, d_rank = d_user[by_rank], d_rank[by_rank]
    per_user = np.bincount(d_user)  # distinct test items per user
    users = len(per_user)
    starts = np.cumsum(per_user) - per_user
    place = np.maximum(d_rank, np.arange(d_rank.size) - starts[d_user])  # one item per place of a list
    inside = d_rank < catalogue  # an item outside the catalogue is in no top K
    gain = 1.0 / np.log2(place + 2.0)
    for k in top_k:
        out[f"hr@{k}"] = float(((ranks < k) & (ranks < catalogue)).mean())
        hit = (place < k) & inside
        out[f"recall@{k}"] = float((np.bincount(d_user, weights=hit, minlength=users) / per_user).mean())
        dcg = np.bincount(d_user, weights=np.where(hit, gain, 0.0), minlength=users)
        ideal = np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))[np.minimum(per_user, k) - 1]
        out[f"ndcg@{k}"] = float((dcg / ideal).mean())
    out["mrr"] = float(np.where(ranks < catalogue, 1.0 / (ranks + 1.0), 0.0).mean())
    return {name: out[name] for name in [f"{m}@{k}" for k in top_k for m in RANK_METRICS] + ["mrr"]}
