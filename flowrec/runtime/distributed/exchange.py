"""Uneven all-to-all exchanges over torch.distributed, started asynchronously.

Counts go first (`start_counts`), then the payload (`start_exchange`) with the counts known. Each
returns the receive buffer and the collective's work handle: the buffer is valid after
`work.wait()`, and other computation (another group's gather or pooling) can run meanwhile.

Example (every rank of a 2-rank group, rank 0 sending 1 id to itself and 2 to rank 1):
    >>> counts, work = start_counts([1, 2], group)  # doctest: +SKIP
    >>> work.wait()  # doctest: +SKIP
    >>> ids, work = start_exchange(torch.tensor([4, 1, 3]), [1, 2], counts.tolist(), group)  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def start_counts(send_counts: list[int], group: dist.ProcessGroup | None,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, dist.Work]:
    """Tell every rank how many items it gets from this one.

    Args:
        send_counts: items this rank sends to each rank (length W).
        group: the process group (None: the default group).
        device: where the counts travel (the payload's device: cuda for nccl).

    Returns:
        Items this rank receives from each rank (W,) int64, valid after the work's `wait()`;
        the work.
    """
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)  # (W,)
    recv = torch.empty_like(send)
    return recv, dist.all_to_all_single(recv, send, group=group, async_op=True)


def start_exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   group: dist.ProcessGroup | None) -> tuple[torch.Tensor, dist.Work]:
    """All-to-all of rows along dim 0 with known per-rank counts.

    Args:
        send: rows for rank 0, then rank 1, ...  # (sum(send_counts), *rest)
        send_counts: rows to each rank.
        recv_counts: rows from each rank (from `start_counts`).
        group: the process group.

    Returns:
        Rows from rank 0, then rank 1, ... each chunk in its sender's order, valid after the
        work's `wait()`;  # (sum(recv_counts), *rest)
        the work.
    """
    send = send.contiguous()
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    work = dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                                  input_split_sizes=send_counts, group=group, async_op=True)
    return recv, work
