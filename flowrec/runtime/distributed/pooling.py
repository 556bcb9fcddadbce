"""Pooling at the requesting rank from the unique rows it received, and its backward.

The same ops as `operators.embedding.PackedEmbeddingBag.lookup` (one sum `embedding_bag`, mean
bags divided by their length), over the unique rows indexed by each id's position among them, so
a rank's output is bitwise the single-process output of its samples.

Example:
    >>> rows = torch.tensor([[1.0], [2.0]])  # unique rows of ids [5, 9]
    >>> pool_unique(torch.tensor([0, 1, 1]), rows, torch.tensor([0, 2, 3]), None, 2).tolist()
    [[[3.0], [2.0]]]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from operators.casting import Casting, casted_row_grads


def pool_unique(inverse: torch.Tensor, unique_rows: torch.Tensor, offsets: torch.Tensor,
                mean_flags: torch.Tensor | None, bags_per_sample: int) -> torch.Tensor:
    """Pooled bags of a batch from its unique rows.

    Args:
        inverse: each id's index into `unique_rows`.  # (nnz,) int64
        unique_rows: the rows of the batch's unique ids.  # (U, D)
        offsets: bag boundaries, bag = b * S + s.  # (B * S + 1,) int64
        mean_flags: mean-pooling flag per bag position (S,) bool, or None (no mean bag).
        bags_per_sample: S.

    Returns:
        Pooled embeddings.  # (B, S, D)
    """
    out = F.embedding_bag(inverse, unique_rows, offsets, mode="sum",
                          include_last_offset=True)  # (NB, D)
    if mean_flags is not None:
        lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(out.dtype)  # (NB,)
        flags = mean_flags.repeat(out.shape[0] // bags_per_sample)
        out = out.div_(torch.where(flags, lengths, torch.ones_like(lengths)).unsqueeze(1))
    return out.view(-1, bags_per_sample, unique_rows.shape[1])


def unique_row_grads(grad_out: torch.Tensor, casting: Casting, dim: int) -> torch.Tensor:
    """One gradient per unique id of the batch (the casted gather-reduce of `grad_out`), also
    for a rank whose slice of the global batch has no bag.

    Args:
        grad_out: gradient of the pooled output.  # (B, S, D)
        casting: the batch's casting.
        dim: D.

    Returns:
        Gradients in `casting.unique_ids` order.  # (U, D)
    """
    if casting.num_bags == 0:
        return grad_out.new_zeros(0, dim)
    return casted_row_grads(grad_out.reshape(casting.num_bags, dim), casting)
