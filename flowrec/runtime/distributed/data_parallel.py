"""Data parallelism of the dense part: `DistributedDataParallel` over the dense modules only.

The packed tables are not parameters (their rows are updated in the embedding backward, across
ranks by `ShardedPackedEmbedding` / `ReplicatedPackedEmbedding` on their own process group), so
DDP wraps just the dense operators. Its gradient buckets are all-reduced as sums, not means: each
rank's loss is its share of the global batch's mean (its samples' summed loss over the global
batch size), so the summed gradients are those of one process on the whole global batch, for the
dense parameters and the embedding rows alike, however unevenly the samples fall on the ranks.

Example (on every rank):
    >>> parallel = DenseParallel(model, world)  # doctest: +SKIP
    >>> logits = parallel.forward(dense, emb, masks)  # doctest: +SKIP
"""
from __future__ import annotations

import inspect
import math
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flowrec.data.batches import rank_slice
from flowrec.runtime.distributed.world import Agreement, World
from flowrec.runtime.nonfinite import NonFiniteLoss, non_finite_head


class _DenseStage(nn.Module):
    """The dense operators of a lowered model as one module (what DDP wraps)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.ops = model.ops
        self._run = model.dense_forward  # a bound method: the model is not a submodule

    def forward(self, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                masks: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._run(dense, emb, masks)


def _sum_buckets(group, bucket):  # DDP checks the runtime annotations; these are (ProcessGroup, GradBucket)
    """DDP communication hook: all-reduce a gradient bucket as a sum (DDP's default averages).
    Returns the future of the summed bucket."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DenseParallel:
    """The dense forward through DDP, and the per-step agreement on the loss.

    Args:
        model: the lowered model (its dense parameters must all be in `model.ops`).
        world: the ranks.
        flags: returns this rank's stop requests (interrupt, stop) before each agreement.
    """

    def __init__(self, model: Any, world: World, flags: Callable[[], tuple[bool, ...]] = lambda: ()) -> None:
        self.model, self.world, self.flags = model, world, flags
        stage = _DenseStage(model)
        outside = {id(p) for p in model.dense_parameters()} - {id(p) for p in stage.parameters()}
        if outside:
            raise ValueError(f"{len(outside)} dense parameter(s) outside the dense operators: "
                             f"data parallelism would not synchronize them")
        device_ids = [world.device.index] if world.device.type == "cuda" else None
        self.stage = stage
        self.ddp = None  # a model of embeddings alone (two towers of ids) has nothing for DDP to sync
        if any(p.requires_grad for p in stage.parameters()):
            # a custom module may hold parameters its forward does not use (one process trains it; DDP
            # waits for their gradients and stops at the next step unless told to look for them)
            self.ddp = DistributedDataParallel(stage, device_ids=device_ids,
                                               find_unused_parameters=bool(getattr(model, "custom", False)),
                                               **_no_buffer_sync())
            self.ddp.register_comm_hook(None, _sum_buckets)
        self.last = Agreement(0.0, False, ())
        self._synced_forward = False

    def forward(self, dense: torch.Tensor, emb: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
                sync: bool = True) -> torch.Tensor:
        """The dense stage's logits; `sync=False` for a micro-batch whose gradients are only
        accumulated (the last one of the step all-reduces them all)."""
        self._synced_forward = sync
        if self.ddp is None:
            return self.stage(dense, emb, masks)
        with nullcontext() if sync else self.ddp.no_sync():
            return self.ddp(dense, emb, masks)

    def first_row(self, global_size: int) -> int:
        """This rank's first row of a global batch of `global_size` (`batches.rank_slice`)."""
        return rank_slice(global_size, self.world.size, self.world.rank)[0]

    def gather_items(self, vectors: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A retrieval head's in-batch candidates over every rank (`gather_over_ranks`)."""
        return gather_over_ranks(vectors, items, self.world)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, global_size: int, cands: Any = None) -> torch.Tensor:
        """This rank's share of the global batch's mean loss, agreed with every rank first.

        Raises NonFiniteLoss on every rank when the loss of any rank is NaN or infinite (before
        any backward, after releasing DDP's expectation of one), so all take the same decision.
        """
        n = labels.shape[0]
        loss = self.model.loss(logits, labels, cands) * (n / global_size) if n else logits.sum() * 0.0
        self.last = self.world.agree(loss, self.flags())
        if self.last.non_finite:
            self._release()
            value = float(loss.detach())
            here = not math.isfinite(value)
            raise NonFiniteLoss(non_finite_head(self.model, logits, labels) if here else "(on another rank)",
                                value if here else float("nan"))
        return loss

    def _release(self) -> None:
        """End DDP's reduction of a forward whose backward will not run (zero gradients, no update)."""
        if self._synced_forward and self.ddp is not None:
            params = [p for p in self.ddp.parameters() if p.requires_grad]
            torch.stack([p.sum() for p in params]).sum().mul(0.0).backward()


def gather_over_ranks(values: torch.Tensor, ids: torch.Tensor, world: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every rank's rows of `values` (differentiable: a row's gradient goes back to its rank,
    summed over the ranks that used it) and `ids`, in rank order, and this rank's first row.
    Ranks may hold different row counts (none, too): rows are padded to the largest for the
    collective and cut after.  # (B_r, D), (B_r,) -> (B, D), (B,), int"""
    from torch.distributed.nn.functional import all_gather

    count = torch.tensor([values.shape[0]], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world.size)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    most = max(sizes)
    pad = most - values.shape[0]
    padded = torch.cat([values, values.new_zeros(pad, values.shape[1])]) if pad else values
    padded_ids = torch.cat([ids, ids.new_full((pad,), -1)]) if pad else ids
    with warnings.catch_warnings():  # its deprecation notice; the replacement has no gloo backward here
        warnings.simplefilter("ignore", FutureWarning)
        parts = all_gather(padded.contiguous())
    id_parts = [torch.empty_like(padded_ids) for _ in range(world.size)]
    dist.all_gather(id_parts, padded_ids.contiguous())
    rows = torch.cat([p[:n] for p, n in zip(parts, sizes)])
    return rows, torch.cat([p[:n] for p, n in zip(id_parts, sizes)]), sum(sizes[:world.rank])


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The sum of `values` over every rank (default group), differentiable: its gradient is the
    sum of the ranks' gradients (batch norm statistics of the global batch)."""
    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings():  # its deprecation notice, on every rank (as `gather_over_ranks`)
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(values)


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's option to skip the per-forward buffer broadcast (the ranks' buffers are equal),
    under its name in this torch (`forward_sync_buffers` replaced `broadcast_buffers`)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}

