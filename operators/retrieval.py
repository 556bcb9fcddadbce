"""Retrieval: a query tower and an item tower scored by a similarity, trained by a softmax over
negatives (two-tower retrieval, Yi et al., RecSys 2019).

The retrieval head passes the two towers through side by side, x = [q | v]  # (B, 2D); the loss
scores each query against candidates:

- in-batch: the candidates of row i are the batch's items v_0 .. v_{B-1}; row i's positive is v_i.
  An item that occurs twice in the batch is not a negative of a row whose positive it is
  (accidental hits removed: logit -inf where item_j == item_i, j != i).
- sampled: the candidates are v_i then N sampled items n_1 .. n_N shared by the batch; a sampled
  item equal to row i's item is removed the same way.

With logQ correction each candidate's logit is lowered by the log of how likely it was to be a
candidate: in-batch, log p(item) (its frequency in the training data); sampled, log(N p(item))
(its expected count among N draws; the positive's too). The loss per row is the cross-entropy of
the positive.

Example:
    >>> q, v = torch.eye(2), torch.eye(2)
    >>> in_batch_softmax(q, v, torch.tensor([0, 1]), "dot", 1.0).shape
    torch.Size([2])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from operators.similarity import EPS

MASKED = float("-inf")  # logit of a removed candidate (an accidental hit)


@dataclass(frozen=True)
class Candidates:
    """What the retrieval loss needs beyond the batch.

    Args:
        vectors: the sampled items' item-tower vectors (None: in-batch).  # (N, D)
        ids: their item ids.  # (N,) int64
        log_q: per item of the table, log of its sampling probability (None: no correction).  # (V,)
        num: N, draws per step (expected count N p of a sampled candidate).
        batch: in-batch candidates of a global batch split over ranks: (item vectors of every
            rank's rows (B, D), their item ids (B,), the global row of this rank's first row);
            None: the rows given to the loss are the whole batch.
    """

    vectors: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    log_q: torch.Tensor | None = None
    num: int = 0
    batch: tuple[torch.Tensor, torch.Tensor, int] | None = None


def towers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and item vectors of a retrieval head's output.  # (B, D), (B, D)"""
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def pair_scores(q: torch.Tensor, v: torch.Tensor, metric: str, temperature: float,
                unit_items: bool = False) -> torch.Tensor:
    """Similarity of every query with every item (`unit_items`: v's rows are already
    `unit_rows`, e.g. a catalogue's from a `UnitRows`).  # (Bq, D), (Bv, D) -> (Bq, Bv)"""
    if metric == "cosine":
        q, v = F.normalize(q, dim=1, eps=EPS), v if unit_items else unit_rows(v)
    return q @ v.T / temperature


def unit_rows(v: torch.Tensor) -> torch.Tensor:
    """The rows of v scaled to unit length (what cosine scores them as).  # (N, D)"""
    return F.normalize(v, dim=1, eps=EPS)


class UnitRows:
    """A catalogue's unit rows for cosine scoring, normalised once per version of the catalogue:
    again when it is another tensor or was written in place (torch counts its writes), so the
    rows it gives are never those of an older catalogue."""

    def __init__(self) -> None:
        self._of: tuple[torch.Tensor, int] | None = None  # the catalogue (held: its id stays its own), its version
        self._rows: torch.Tensor | None = None

    def __call__(self, catalogue: torch.Tensor) -> torch.Tensor:
        if self._of is None or self._of[0] is not catalogue or self._of[1] != catalogue._version:
            self._rows = unit_rows(catalogue)
            self._of = (catalogue, catalogue._version)
        return self._rows


def row_scores(q: torch.Tensor, v: torch.Tensor, metric: str, temperature: float) -> torch.Tensor:
    """Similarity of each query with its own item.  # (B, D), (B, D) -> (B,)"""
    if metric == "cosine":
        q, v = F.normalize(q, dim=1, eps=EPS), F.normalize(v, dim=1, eps=EPS)
    return (q * v).sum(dim=1) / temperature


def in_batch_softmax(q: torch.Tensor, v: torch.Tensor, items: torch.Tensor, metric: str, temperature: float,
                     log_q: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """Per-row softmax cross-entropy over the batch's items.  # (Bq,)

    Args:
        q: query vectors of rows first .. first + Bq - 1 of the batch.  # (Bq, D)
        v: item vectors of every row of the batch.  # (B, D)
        items: item ids of every row of the batch.  # (B,) int64
        metric: dot or cosine.
        temperature: scores are divided by it.
        log_q: log frequency of each item id (None: no logQ correction).  # (V,)
        first: the batch row of q's first row (a rank's slice of a global batch).
    """
    logits = pair_scores(q, v, metric, temperature)  # (Bq, B)
    if log_q is not None:
        logits = logits - log_q[items].to(logits.dtype).unsqueeze(0)
    target = torch.arange(first, first + q.shape[0], device=q.device)  # (Bq,)
    same = items.unsqueeze(0) == items[target].unsqueeze(1)  # (Bq, B)
    same[torch.arange(q.shape[0], device=q.device), target] = False
    logits = logits.masked_fill(same, MASKED)
    return F.cross_entropy(logits, target, reduction="none")


def sampled_softmax(q: torch.Tensor, v: torch.Tensor, items: torch.Tensor, cand: Candidates, metric: str,
                    temperature: float) -> torch.Tensor:
    """Per-row softmax cross-entropy of the positive against N sampled items.  # (B,)

    Args:
        q: query vectors.  # (B, D)
        v: the positive items' vectors.  # (B, D)
        items: the positive items' ids.  # (B,) int64
        cand: the sampled items (`vectors`, `ids`), and `log_q` / `num` for the correction.
        metric: dot or cosine.
        temperature: scores are divided by it.
    """
    pos = row_scores(q, v, metric, temperature).unsqueeze(1)  # (B, 1)
    # the items' vectors in the queries' dtype: an item tower run under bf16 autocast gives bf16
    # vectors, the queries (head outputs) are fp32, as `retrieval_loss` casts in-batch items
    neg = pair_scores(q, cand.vectors.to(q.dtype), metric, temperature)  # (B, N)
    if cand.log_q is not None:
        log_n = torch.log(torch.tensor(float(cand.num), dtype=pos.dtype, device=pos.device))
        pos = pos - (cand.log_q[items].to(pos.dtype) + log_n).unsqueeze(1)
        neg = neg - (cand.log_q[cand.ids].to(neg.dtype) + log_n).unsqueeze(0)
    neg = neg.masked_fill(cand.ids.unsqueeze(0) == items.unsqueeze(1), MASKED)
    logits = torch.cat([pos, neg], dim=1)  # (B, 1 + N)
    return F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device), reduction="none")


def retrieval_loss(x: torch.Tensor, items: torch.Tensor, cand: Candidates | None, metric: str,
                   temperature: float, negatives: str) -> torch.Tensor:
    """The retrieval head's per-row loss from its output [q | v] and the rows' item ids.  # (B,)"""
    q, v = towers(x)
    cand = cand if cand is not None else Candidates()
    if negatives == "in_batch":
        if cand.batch is not None:  # every rank's rows are candidates
            v_all, items_all, first = cand.batch
            return in_batch_softmax(q, v_all.to(q.dtype), items_all, metric, temperature, cand.log_q, first)
        return in_batch_softmax(q, v, items, metric, temperature, cand.log_q)
    if cand.vectors is None:
        raise ValueError("sampled negatives: the step gave no sampled items (Candidates.vectors)")
    return sampled_softmax(q, v, items, cand, metric, temperature)

