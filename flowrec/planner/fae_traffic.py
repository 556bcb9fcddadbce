"""Host<->device row traffic of a `static_hot` group (FAE's hot-embedding layout), per step.

FAE trains hot batches (every id of every sample hot) entirely on the device and cold batches
with their cold rows from the host; the runtime (`flowrec.runtime.caches.static_hot`) moves, per
cold batch, the batch's distinct cold rows to the device and their gradients back (the update of
a cold row runs on the host), and at every switch between hot and cold batches writes the hot rows
updated since the previous switch, with their optimizer state, back to the host. With `L` lookups
per batch, `h` the share of lookups that hit the hot rows and `n` ids per sample:

* a sample is hot with probability `p = h ** n` (ids independent); cold batches are a share
  `c = 1 - p` of the batches and hold all the cold lookups, `L / c` lookup draws' worth each;
* cold rows per step: `c * sum over cold rows r of (1 - exp(-(L / c) * p_r))`, twice `dim` elements
  each (rows in, gradients out);
* switches per batch: `s = 2 * min(p, c)` (the scarcer kind comes in isolated runs between the
  other's: `flowrec.runtime.caches.fae_batches`), plus 2 per epoch when the epoch's length is
  known (the batcher empties both pools at the end of an epoch), at most 1; a switch writes the
  distinct hot rows touched
  over the `1 / s` batches since the last one: `s * sum over hot rows r of (1 - exp(-L * p_r / s))`
  rows per step, each with its optimizer state. Without switches nothing is written back.

The one-time copy of the hot rows to the device at the start is not per-step traffic.

Example:
    >>> from flowrec.planner.access import zipf_model
    >>> hot_cold_bytes(zipf_model(10_000), cache_rows=10_000, lookups=4096, ids_per_sample=4,
    ...                elem_row_bytes=64, row_bytes=68)
    0.0
"""
from __future__ import annotations

from math import exp

from flowrec.planner.access import AccessModel


def split_segments(model: AccessModel, rows: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(hot, cold) segments of `model`: the first `rows` rows a static hot set fills
    (`AccessModel.fill_order`) and the rest (probabilities unchanged)."""
    hot, cold, left = [], [], float(rows)
    for count, p, _ in model.fill_order():
        take = min(count, max(left, 0.0))
        if take > 0:
            hot.append((take, p))
        if count - take > 0:
            cold.append((count - take, p))
        left -= take
    return hot, cold


def _distinct(segments: list[tuple[float, float]], draws: float) -> float:
    return sum(count * (1.0 - exp(-draws * p)) for count, p in segments)


def hot_cold_bytes(model: AccessModel, cache_rows: int, lookups: float, ids_per_sample: float,
                   elem_row_bytes: int, row_bytes: int, epoch_batches: float | None = None) -> float:
    """Row bytes a static_hot group moves per step (see the module docstring).

    Args:
        model: the group's access distribution (`flowrec.planner.cost.group_access`).
        cache_rows: hot slots on the device (filled with at most the rows FAE's sample counts,
            `AccessModel.hot_rows`).
        lookups: ids looked up per step.
        ids_per_sample: ids per sample in the group.
        elem_row_bytes: bytes of one row's weights (dim * element size).
        row_bytes: bytes of one row with its optimizer state.
        epoch_batches: batches per epoch, when known (an access profile knows the dataset's rows).
    """
    hot, cold = split_segments(model, model.hot_rows(cache_rows))
    hit = min(1.0, sum(count * p for count, p in hot))
    p_hot = hit ** max(ids_per_sample, 1.0)
    c = 1.0 - p_hot
    moved = 0.0
    if c > 0 and cold:
        moved += 2 * elem_row_bytes * c * _distinct(cold, lookups / c)
    switches = 2 * min(p_hot, c)
    if epoch_batches and 0 < p_hot < 1:
        switches = min(1.0, switches + 2 / max(epoch_batches, 1.0))
    if switches > 0 and hot:
        moved += row_bytes * switches * _distinct(hot, lookups / switches)
    return moved
