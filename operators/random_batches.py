"""Skewed random batches for tests and benchmarks: Zipf-distributed ids in the packed layout.

Example:
    >>> g = torch.Generator().manual_seed(0)
    >>> ids = zipf_ids(100, 1000, 1.1, g)
    >>> bool((ids >= 0).all() and (ids < 100).all())
    True
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from operators.packed_layout import PackedLayout


def zipf_ids(rows: int, n: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """`n` ids in [0, rows) with P(rank k) ~ 1 / k**alpha, ranks scattered over the rows.

    Args:
        rows: table rows.
        n: number of ids.
        alpha: Zipf exponent (> 0; about 1.05 to 1.2 for CTR data).
        gen: the random generator.
    """
    if rows == 1:
        return torch.zeros(n, dtype=torch.int64)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    # Inverse CDF of the continuous power law on [1, rows + 1).
    if abs(alpha - 1.0) < 1e-9:
        rank = torch.exp(u * torch.log(torch.tensor(rows + 1.0, dtype=torch.float64)))
    else:
        top = (rows + 1.0) ** (1.0 - alpha)
        rank = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - alpha))
    rank = rank.floor().to(torch.int64).clamp_(1, rows) - 1  # (n,) 0 = hottest
    salt = int(torch.randint(1, 2**31 - 1, (1,), generator=gen))
    return (rank * 2654435761 + salt) % rows  # a fixed scatter of ranks over rows


@dataclass(frozen=True)
class PackedBatch:
    """One group's batch in the packed layout.

    Args:
        ids: packed row ids.  # (nnz,) int64
        offsets: bag boundaries, bag index = b * S + s.  # (B * S + 1,) int64
        batch_size: B.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    batch_size: int


def random_batch(group: PackedLayout, batch_size: int, gen: torch.Generator,
                 alpha: float = 1.1, empty_prob: float = 0.1) -> PackedBatch:
    """A random batch of `group` in the packed layout (multi-hot bags of random length).

    Pooled fields get bags of 0..max_len ids (0 only with probability `empty_prob` when
    max_len > 1; one-hot fields always 1 id); unpooled sequences get L single-id bags, the tail
    positions past a random length empty.
    """
    slots = {t.table: t for t in group.tables}
    lengths, values = [], []
    for f in group.fields:
        slot = slots[f.table]
        if f.pooling == "none":
            seq = torch.randint(0, f.max_len + 1, (batch_size, 1), generator=gen)
            lens = (torch.arange(f.max_len).unsqueeze(0) < seq).to(torch.int64)  # (B, L)
        elif f.max_len == 1:
            lens = torch.ones(batch_size, 1, dtype=torch.int64)
        else:
            lens = torch.randint(1, f.max_len + 1, (batch_size, 1), generator=gen)
            lens = torch.where(torch.rand(batch_size, 1, generator=gen) < empty_prob, 0, lens)
        lengths.append(lens)
        n = int(lens.sum())
        values.append(zipf_ids(slot.rows, n, alpha, gen) + slot.row_offset)
    lens = torch.cat(lengths, dim=1)  # (B, S) sample-major bag lengths
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens.reshape(-1), 0, out=offsets[1:])
    # Field-major order of the generated ids -> sample-major packed order.
    num_bags = lens.numel()
    bag_index = torch.arange(num_bags).reshape(lens.shape)  # (B, S) global bag of (b, s)
    fm_bags = torch.cat([bag_index[:, s].reshape(-1) for s in _field_columns(lengths)])
    fm_lens = lens.reshape(-1)[fm_bags]
    fm_values = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
    fm_starts = torch.cumsum(fm_lens, 0) - fm_lens
    within = torch.arange(fm_values.numel()) - torch.repeat_interleave(fm_starts, fm_lens)
    dest = torch.repeat_interleave(offsets[:-1][fm_bags], fm_lens) + within
    ids = torch.empty_like(fm_values)
    ids[dest] = fm_values
    return PackedBatch(ids, offsets, batch_size)


def _field_columns(lengths: list[torch.Tensor]) -> list[slice]:
    out, start = [], 0
    for lf in lengths:
        out.append(slice(start, start + lf.shape[1]))
        start += lf.shape[1]
    return out
