"""Uneven all-to-all exchanges over torch.distributed: counts first, then the payload.

Example (every rank of a 2-rank group, rank 0 sending 1 id to itself and 2 to rank 1):
    >>> got, recv_counts = exchange_ids(torch.tensor([4, 1, 3]), [1, 2], group)  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(send_counts: list[int], group: dist.ProcessGroup | None,
                    device: torch.device | str | None = None) -> list[int]:
    """Tell every rank how many items it gets from this one; return how many this one gets.

    Args:
        send_counts: items this rank sends to each rank (length W).
        group: the process group (None: the default group).
        device: where the counts travel (the payload's device: cuda for nccl).

    Returns:
        Items this rank receives from each rank (length W).
    """
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)  # (W,)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
             group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all of rows along dim 0 with known per-rank counts.

    Args:
        send: rows for rank 0, then rank 1, ...  # (sum(send_counts), *rest)
        send_counts: rows to each rank.
        recv_counts: rows from each rank (from `exchange_counts`).
        group: the process group.

    Returns:
        Rows from rank 0, then rank 1, ... each chunk in its sender's order.  # (sum(recv_counts), *rest)
    """
    send = send.contiguous()
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    return recv


def exchange_ids(send: torch.Tensor, send_counts: list[int], group: dist.ProcessGroup | None
                 ) -> tuple[torch.Tensor, list[int]]:
    """Counts first, then the ids: the ids every rank sent here, and how many from each rank."""
    recv_counts = exchange_counts(send_counts, group, send.device)
    return exchange(send, send_counts, recv_counts, group), recv_counts
