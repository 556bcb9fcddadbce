"""Non-finite losses and parameters: caught before they update anything or reach a checkpoint.

`LossGuard` wraps a lowered model for `train_step`: its `loss` raises `NonFiniteLoss` (naming the
head) when the batch loss is NaN or infinite, before `backward` runs, so neither the fused sparse
update (which runs inside backward) nor the dense optimizer step sees the batch. With micro-batches
the earlier slices only accumulated gradients, which the next step's `zero_grad` discards.

Example:
    >>> loss = train_step(LossGuard(model), optimizer, batch)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

NAN_POLICIES = ("stop", "skip-batch")


class NonFiniteLoss(Exception):
    """The loss of a batch is NaN or infinite; nothing was updated."""

    def __init__(self, head: str, value: float) -> None:
        super().__init__(f"loss {value} in head {head}")
        self.head = head
        self.value = value


class TrainingStopped(RuntimeError):
    """Training cannot go on (non-finite loss or parameters); the message is one line."""


class LossGuard:
    """`model` as `train_step` uses it, with a loss that refuses non-finite values."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, cands: Any = None) -> torch.Tensor:
        loss = self._model.loss(logits, labels, cands)
        if not bool(torch.isfinite(loss.detach()).all()):
            raise NonFiniteLoss(non_finite_head(self._model, logits, labels, cands), float(loss.detach()))
        return loss


def non_finite_head(model: Any, logits: Any, labels: torch.Tensor, cands: Any = None) -> str:
    """The name of the head whose loss is NaN or infinite (`model.head_names`, `model.loss.per_head`)."""
    names: Sequence[str] = getattr(model, "head_names", ())
    per_head = getattr(model.loss, "per_head", None)
    if per_head is None or not names:
        return "(unknown)"
    heads = model.loss.split(logits) if isinstance(logits, torch.Tensor) else list(logits)
    with torch.no_grad():
        parts = per_head(heads, labels, cands)
    for name, part in zip(names, parts):
        if not bool(torch.isfinite(part).all()):
            return name
    return "(the weighted sum of the heads)"


CHECK_CHUNK_ELEMS = 1 << 22  # elements per isfinite call: bounded temporaries on multi-GiB tables


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, or None."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not all_finite(t):
            return name
    return None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite.

    NaN and inf survive a sum (inf + finite = inf, inf - inf = NaN), so a finite sum proves every
    element finite in one vectorized pass without a temporary as large as the tensor; a sum that
    is not finite (a NaN or inf, or finite values overflowing it) is settled element-wise in chunks.
    """
    if bool(torch.isfinite(t.sum())):
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[a:a + CHECK_CHUNK_ELEMS]).all())
               for a in range(0, flat.numel(), CHECK_CHUNK_ELEMS))


# bits of a bfloat16 (numpy has no bfloat16: read as int16) that are all set in NaN and inf only
BF16_EXPONENT = 0x7F80
NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def all_finite_here(t: torch.Tensor) -> bool:
    """`all_finite` computed on the calling thread alone (numpy), for a background writer.

    torch's reductions run on its intra-op threads, whose workers go on spinning after each call:
    a checkpoint writer checking 1 MiB chunks of a 2 GiB table that way burned ~1.5-3 s of CPU on
    those threads (measured: process CPU 4.0-5.4 s for 2.1-2.9 s on the writer's own thread), CPU
    that training on the same cores was waiting for. numpy uses no other thread. The same answer as
    `all_finite`: a finite sum proves every element finite, else element-wise; bfloat16 by its
    exponent bits. Tensors numpy cannot read (other devices, strides, dtypes) go to `all_finite`.
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in (*NUMPY_FLOATS, torch.bfloat16):
        return all_finite(t)
    if t.dtype == torch.bfloat16:
        bits = t.detach().reshape(-1).view(torch.int16).numpy()
        return not bool(np.any((bits & BF16_EXPONENT) == BF16_EXPONENT))
    values = t.detach().reshape(-1).numpy()
    with np.errstate(all="ignore"):  # an overflowing sum is settled element-wise below
        if bool(np.isfinite(np.add.reduce(values))):
            return True
    return all(bool(np.isfinite(values[a:a + CHECK_CHUNK_ELEMS]).all())
               for a in range(0, values.size, CHECK_CHUNK_ELEMS))
